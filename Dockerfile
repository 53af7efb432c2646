# locomm peer image: `locomm-peer` as the entrypoint, a non-root user, iproute2 for link shaping.
#
#   docker build -t locomm .                                    # python:3.11-slim, CPU torch from the indexes
#   docker build -t locomm --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # CUDA torch
#   docker build -t locomm --build-arg BASE_IMAGE=locomm-base:bookworm --build-arg WHEELHOUSE=.wheelhouse .
#
# The last form builds with no network: the base comes from scripts/docker-base.sh and every wheel from
# a folder filled on the host by docker/wheelhouse.sh (`pip download`/`pip wheel`). A WHEELHOUSE folder
# must lie inside the build context. README.md, "Docker", has the details.
ARG BASE_IMAGE=python:3.11-slim

# ---- deps: a virtual environment with torch and the dependencies of setup.cfg (cached until they change)
FROM ${BASE_IMAGE} AS deps
ARG WHEELHOUSE=docker/no-wheels
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/locomm
COPY setup.cfg docker/requirements.py /tmp/build/
COPY ${WHEELHOUSE} /tmp/wheels/
RUN set -eu; python3 /tmp/build/requirements.py /tmp/build/setup.cfg > /tmp/build/requirements.txt; \
    pip=/opt/locomm/bin/pip; \
    if ls /tmp/wheels/*.whl >/dev/null 2>&1; then \
        echo "installing from the wheelhouse ($(ls /tmp/wheels/*.whl | wc -l) wheels), no network"; \
        $pip install --no-index --find-links /tmp/wheels "torch==${TORCH_VERSION}" -r /tmp/build/requirements.txt \
            setuptools wheel; \
    else \
        $pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
        $pip install -r /tmp/build/requirements.txt setuptools wheel; \
    fi; \
    rm -rf /tmp/wheels /tmp/build

# ---- the image
FROM ${BASE_IMAGE}
# iproute2 (tc) and util-linux (setpriv, flock): the debootstrap base has both; python:3.11-slim gets iproute2.
RUN if ! command -v tc >/dev/null || ! command -v setpriv >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends iproute2 util-linux \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    useradd --system --uid 10001 --user-group --create-home --home-dir /home/locomm --shell /usr/sbin/nologin locomm; \
    mkdir -p /data /swarm /etc/locomm; chown locomm:locomm /data /swarm
ENV PATH=/opt/locomm/bin:$PATH VIRTUAL_ENV=/opt/locomm PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    LOCOMM_METRICS_PORT=9100 NUMBA_CACHE_DIR=/opt/locomm-numba
COPY --from=deps /opt/locomm /opt/locomm
COPY docker/entrypoint.sh /usr/local/bin/locomm-entrypoint
COPY docker/swarm_addr.py docker/healthcheck.py docker/warm_up.py /opt/locomm-docker/
COPY setup.cfg pyproject.toml README.md /opt/locomm-src/
COPY locomm /opt/locomm-src/locomm
RUN pip install --no-index --no-deps --no-build-isolation /opt/locomm-src \
    && rm -rf /opt/locomm-src/build /opt/locomm-src/*.egg-info \
    && locomm-peer --version \
    && OMP_NUM_THREADS=1 python3 /opt/locomm-docker/warm_up.py && chown -R locomm:locomm "$NUMBA_CACHE_DIR"
# The entrypoint runs as root only to shape the link (tc needs NET_ADMIN); it then drops to `locomm`.
WORKDIR /data
EXPOSE 31337 9100
HEALTHCHECK --interval=5s --timeout=5s --start-period=180s --retries=3 CMD ["python3", "/opt/locomm-docker/healthcheck.py"]
ENTRYPOINT ["/usr/local/bin/locomm-entrypoint"]
CMD ["--help"]

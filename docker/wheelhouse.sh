#!/usr/bin/env bash
# Fill a wheelhouse for an offline image build (Dockerfile's WHEELHOUSE build argument):
# torch (CPU) and every dependency in setup.cfg's install_requires, plus setuptools and wheel, as wheels.
#
#   docker/wheelhouse.sh [DIR]         default DIR: .wheelhouse (gitignored, inside the build context)
#
# Runs pip on the host, so it uses the host's indexes and wheel stores; $TORCH_SPEC (default
# torch==2.13.0) picks torch. It refuses a CUDA torch unless ALLOW_CUDA=1: a plain `torch` from PyPI is
# the multi-GB CUDA build, and a CPU image only needs the +cpu wheel (README.md, "Docker").
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.wheelhouse}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
mapfile -t REQS < <("$PY" docker/requirements.py setup.cfg)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
if ! "$PY" -m pip wheel -q --wheel-dir "$DIR" "${TORCH_SPEC:-torch==2.13.0}" "${REQS[@]}" 'setuptools>=64' wheel \
        >"$LOG" 2>&1; then
    grep -v "is ignored: it is neither" "$LOG" | tail -n 20 >&2
    echo "wheelhouse: pip wheel failed" >&2
    exit 2
fi
if [ "${ALLOW_CUDA:-0}" != 1 ] && ls "$DIR" | grep -qiE '^nvidia_|^torch-[^+]*-cp'; then
    echo "wheelhouse: $DIR holds a CUDA torch (nvidia-* wheels or a torch without +cpu);" \
         "install the CPU wheel (--index-url https://download.pytorch.org/whl/cpu) or set ALLOW_CUDA=1" >&2
    exit 2
fi
echo "wheelhouse: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"

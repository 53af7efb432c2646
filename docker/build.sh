#!/usr/bin/env bash
# Build the locomm image on a machine that may have no registry access at all (what .ci/run and
# tests/test_compose.py use). With registry access, `docker compose build` or `docker build .` is enough.
#
#   docker/build.sh                      tag: $LOCOMM_IMAGE (default locomm:latest)
#
# 1. base: $BASE_IMAGE if set; else python:3.11-slim when it is already local; else the debootstrap
#    base of scripts/docker-base.sh (locomm-base:bookworm, built once, cached by tag);
# 2. wheels: $WHEELHOUSE (default .wheelhouse), filled by docker/wheelhouse.sh when setup.cfg's
#    requirements or $TORCH_SPEC changed since it was last filled;
# 3. docker build with both as build arguments: the install step uses no network.
# Prints the seconds each step took.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG="${LOCOMM_IMAGE:-locomm:latest}"
WHEELHOUSE="${WHEELHOUSE:-.wheelhouse}"
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

docker info >/dev/null 2>&1 || { echo "docker/build.sh: no Docker engine answers" >&2; exit 2; }

t=$(now)
BASE="${BASE_IMAGE:-}"
if [ -z "$BASE" ]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1; then
        BASE=python:3.11-slim
    else
        BASE=locomm-base:bookworm
        scripts/docker-base.sh "$BASE"
    fi
fi
echo "docker/build.sh: base $BASE ($(took "$t") s)"

t=$(now)
stamp="$WHEELHOUSE/.requirements"
want="$(python3 docker/requirements.py setup.cfg; echo "${TORCH_SPEC:-torch==2.13.0}")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    docker/wheelhouse.sh "$WHEELHOUSE"
    printf '%s\n' "$want" > "$stamp"
fi
echo "docker/build.sh: wheelhouse $WHEELHOUSE ($(took "$t") s)"

t=$(now)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! docker build --build-arg BASE_IMAGE="$BASE" --build-arg WHEELHOUSE="$WHEELHOUSE" -t "$TAG" . >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "docker/build.sh: docker build failed" >&2
    exit 2
fi
size=$(docker image inspect -f '{{.Size}}' "$TAG")
echo "docker/build.sh: image $TAG, $((size / 1000000)) MB ($(took "$t") s)"

#!/usr/bin/env bash
# Build a local Debian bookworm base image (Python 3.11, python3-venv, pip, iproute2) with debootstrap and
# `docker import`, for machines that cannot pull python:3.11-slim from a registry.
#
#   scripts/docker-base.sh [TAG]          default TAG: locomm-base:bookworm
#
# Idempotent and cached by tag: when TAG already exists it prints the tag and exits at once. The root
# filesystem is kept under $LOCOMM_ROOTFS_CACHE (default /var/cache/locomm) so a deleted image is
# re-imported in seconds. The mirror is the machine's own Debian mirror (from its apt sources) unless
# $DEBIAN_MIRROR says otherwise. Needs root, debootstrap and a running Docker engine.
#
# Use the result with:  docker build --build-arg BASE_IMAGE=locomm-base:bookworm ...
set -euo pipefail

TAG="${1:-locomm-base:bookworm}"
SUITE=bookworm
CACHE="${LOCOMM_ROOTFS_CACHE:-/var/cache/locomm}"
ROOTFS="$CACHE/rootfs-$SUITE"

die() { echo "docker-base: $*" >&2; exit 2; }

command -v docker >/dev/null || die "no docker CLI on PATH"
docker info >/dev/null 2>&1 || die "no Docker engine answers (is dockerd running?)"
if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "docker-base: $TAG exists (cached)"
    exit 0
fi

mirror() {
    # The first non-security Debian URI of the apt sources, deb822 (*.sources) or one-line (*.list) style.
    local uri
    uri=$( { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) print $i}';
             cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
               | awk '$1=="deb" {for (i=2;i<=NF;i++) if ($i !~ /^\[/ && $i !~ /\]$/) {print $i; break}}'; } \
           | grep -v -- '-security' | grep -i debian | head -n 1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

if [ ! -f "$ROOTFS/.locomm-complete" ]; then
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    MIRROR="${DEBIAN_MIRROR:-$(mirror)}"
    echo "docker-base: debootstrap $SUITE from $MIRROR into $ROOTFS"
    mkdir -p "$CACHE"
    TMP="$ROOTFS.partial"
    rm -rf "$TMP"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,iproute2 "$SUITE" "$TMP" "$MIRROR" \
        > "$CACHE/debootstrap.log" 2>&1 || { tail -n 20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
    # Smaller image: no package cache, no lists, no docs.
    rm -rf "$TMP"/var/cache/apt/archives/*.deb "$TMP"/var/lib/apt/lists/* "$TMP"/usr/share/doc/* \
        "$TMP"/usr/share/man/* "$TMP"/usr/share/locale/*
    touch "$TMP/.locomm-complete"
    rm -rf "$ROOTFS"
    mv "$TMP" "$ROOTFS"
fi

echo "docker-base: importing $ROOTFS as $TAG"
tar --exclude=./.locomm-complete --numeric-owner -C "$ROOTFS" -c . \
    | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "docker-base: built $TAG"

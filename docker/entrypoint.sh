#!/bin/bash
# locomm-entrypoint: the image's entrypoint. Its arguments are those of `locomm-peer`.
#
# As root (the image's default user) it
# 1. shapes the container's link when $LINK_RATE is set (e.g. 80mbit; empty: unshaped), with tc tbf:
#    upload on the egress of $LINK_DEV (default eth0), download on the egress of an ifb device that the
#    ingress of $LINK_DEV is redirected to. Needs `cap_add: NET_ADMIN`;
# 2. with $LOCOMM_SLOTS=N, takes the first free one of N data folders /data/peer-K (a flock held for the
#    life of the peer) and runs there: several replicas of a service share one named volume, and a
#    restarted replica takes a free folder again, with its identity key and checkpoint;
# 3. with $LOCOMM_PUBLISH_ID=FILE, creates the identity key ./identity.key if absent and writes its peer
#    id to FILE (the bootstrap: its multiaddr is then known to the others);
# 4. with $LOCOMM_BOOTSTRAP=HOST:PORT, adds `--initial-peers /ip4/IP/tcp/PORT/p2p/ID` to `join` and
#    `status` when they have none (ID from $LOCOMM_BOOTSTRAP_ID, default /swarm/bootstrap.id);
# then drops to the unprivileged user `locomm` (setpriv: no capabilities, no new privileges) and execs
# `locomm-peer`, or, for `exec CMD ARGS...`, CMD itself (a shell or a probe in the shaped container).
# Run as another user (docker run --user), it skips 1 and the privilege drop.
set -euo pipefail

log() { echo "locomm-entrypoint: $*" >&2; }
die() { log "error: $*"; exit 2; }

USER_NAME=locomm
HELPER=/opt/locomm-docker/swarm_addr.py
ROOT=0
[ "$(id -u)" = 0 ] && ROOT=1

as_user() {  # run a command as the unprivileged user (or as whoever we are)
    if [ "$ROOT" = 1 ]; then
        HOME=/home/$USER_NAME setpriv --reuid="$USER_NAME" --regid="$USER_NAME" --init-groups \
            --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
    else
        "$@"
    fi
}

rate_bps() {  # 80mbit -> 80000000; anything else -> empty
    echo "$1" | awk 'match(tolower($0), /^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit)$/) {
        n = $0 + 0; u = tolower($0); sub(/^[0-9.]+/, "", u);
        m = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1;
        printf "%d\n", n * m }'
}

shape() {
    local rate="$1" dev="${LINK_DEV:-eth0}" bps burst
    bps=$(rate_bps "$rate")
    [ -n "$bps" ] && [ "$bps" -gt 0 ] || die "LINK_RATE=$rate: expected a rate like 80mbit, 500kbit or 1gbit (empty: unshaped)"
    [ "$ROOT" = 1 ] || die "LINK_RATE=$rate: shaping needs the entrypoint to start as root (drop --user)"
    command -v tc >/dev/null || die "LINK_RATE=$rate: tc (iproute2) is not in this image"
    if tc qdisc show dev "$dev" 2>/dev/null | grep -q '^qdisc tbf'; then
        return  # already shaped: a `docker exec` through this entrypoint, or a restarted container
    fi
    # tbf needs a burst of at least rate/HZ, and a veth hands it GSO packets of up to 64 KiB.
    burst=$(( bps / 8 / 100 )); [ "$burst" -ge 65536 ] || burst=65536
    local err
    if ! err=$(tc qdisc replace dev "$dev" root tbf rate "${bps}bit" burst "$burst" latency 50ms 2>&1); then
        die "LINK_RATE=$rate: cannot shape $dev ($err); the container needs cap_add: [NET_ADMIN]"
    fi
    local down="download unshaped"
    if err=$( { ip link add ifb0 type ifb 2>/dev/null || ip link show ifb0 >/dev/null; } 2>&1 \
              && ip link set ifb0 up 2>&1 \
              && tc qdisc replace dev ifb0 root tbf rate "${bps}bit" burst "$burst" latency 50ms 2>&1 \
              && tc qdisc replace dev "$dev" handle ffff: ingress 2>&1 \
              && tc filter replace dev "$dev" parent ffff: protocol all prio 1 u32 match u32 0 0 \
                     action mirred egress redirect dev ifb0 2>&1 ); then
        down="download on ifb0"
    else
        log "warning: cannot shape the download side (${err:-no ifb}); on the host, 'modprobe ifb' helps"
    fi
    log "link shaped to $rate ($bps bit/s): upload on $dev, $down (tbf burst $burst B, 50 ms queue)"
}

take_slot() {
    local n="$1" base="${LOCOMM_DATA:-/data}" k dir
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || die "LOCOMM_SLOTS=$n: expected a number >= 1"
    for ((k = 0; k < n; k++)); do
        dir="$base/peer-$k"
        mkdir -p "$dir"
        exec {SLOT_FD}>"$dir/.lock"
        if flock -n "$SLOT_FD"; then  # held until the peer exits: the fd passes through exec
            [ "$ROOT" = 1 ] && chown -R "$USER_NAME:$USER_NAME" "$dir"
            cd "$dir"
            log "data folder $dir"
            return
        fi
        exec {SLOT_FD}>&-
    done
    die "all $n data folders in $base are taken by running peers; raise LOCOMM_SLOTS"
}

if [ -n "${LINK_RATE:-}" ] && [ "$LINK_RATE" != none ]; then
    shape "$LINK_RATE"
fi

if [ -n "${LOCOMM_SLOTS:-}" ]; then
    take_slot "$LOCOMM_SLOTS"
fi

if [ -n "${LOCOMM_PUBLISH_ID:-}" ]; then
    [ "$ROOT" = 1 ] && { mkdir -p "$(dirname "$LOCOMM_PUBLISH_ID")"; chown "$USER_NAME:$USER_NAME" "$(dirname "$LOCOMM_PUBLISH_ID")"; }
    peer_id=$(as_user python3 "$HELPER" identity identity.key "$LOCOMM_PUBLISH_ID") || die "cannot create identity.key"
    log "identity $peer_id (published in $LOCOMM_PUBLISH_ID)"
fi

if [ -n "${LOCOMM_BOOTSTRAP:-}" ] && [ $# -ge 1 ] && { [ "$1" = join ] || [ "$1" = status ]; }; then
    case " $* " in
        *" --initial-peers"*) ;;
        *)
            host="${LOCOMM_BOOTSTRAP%:*}"; port="${LOCOMM_BOOTSTRAP##*:}"
            [ -n "$host" ] && [[ "$port" =~ ^[0-9]+$ ]] || die "LOCOMM_BOOTSTRAP=$LOCOMM_BOOTSTRAP: expected HOST:PORT"
            maddr=$(python3 "$HELPER" maddr "$host" "$port" "${LOCOMM_BOOTSTRAP_ID:-/swarm/bootstrap.id}") || exit 2
            cmd="$1"; shift
            set -- "$cmd" --initial-peers "$maddr" "$@"
            log "bootstrap $maddr"
            ;;
    esac
fi

if [ "$ROOT" = 1 ]; then
    export HOME=/home/$USER_NAME
fi
if [ $# -ge 1 ] && [ "$1" = exec ]; then
    shift
    [ $# -ge 1 ] || die "exec: no command given"
    exec_args=("$@")
else
    exec_args=(locomm-peer "$@")
fi
if [ "$ROOT" = 1 ]; then
    exec setpriv --reuid="$USER_NAME" --regid="$USER_NAME" --init-groups --inh-caps=-all --bounding-set=-all \
        --no-new-privs -- "${exec_args[@]}"
fi
exec "${exec_args[@]}"

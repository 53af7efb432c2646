"""Consumer-link bench with real peers: one network namespace per `locomm-peer join` process.

Every peer runs in its own namespace on one Linux bridge (locomm/testing/netlab.py), its veth shaped with tc
tbf in both directions: the host end's egress is the peer's upload, the bridge end's egress its
download. Peer 0 starts the swarm and writes its multiaddrs to an announce file; the others join
through the one on peer 0's namespace address, all with the same run spec file. With ``--nat K`` the
last K peers sit behind a NAT router each (MASQUERADE, no inbound): they dial out, nobody dials in; they
join with ``--reachability private`` (``--nat-reachability auto``: AutoNAT finds out), so they reserve a
relay slot on the open peers at once (libp2p circuit relay v2; hole punching is tried over it).
``--relays K`` starts K bare relays (``locomm/testing/relay.py``) on the open hosts and gives the NATed
peers them and peer 0 as ``--relay``: go-libp2p's auto-relay waits for 4 relay candidates (or 3 minutes).
``--wan 11.77``: the bridge's subnet looks public to libp2p (netlab.Lab's ``wan``), which relayed addresses
and hole punching need; nothing leaves the lab's namespaces.
``--island K --island-rate 1gbit``: the first K peers join as one island (``--island isl0 --island-size K``) and
the traffic among their K namespaces is shaped at the island rate, all else at ``--rate``
(``locomm/testing/netshape.py``: htb with u32 filters on the members' veth ends; docs/results/island-links.md);
the other peers start once the island has formed (``--island-together``: at once).

    sudo python benchmarks/links.py --config benchmarks/configs/links-nano.toml --rounds 3 --rate 80mbit
    sudo python benchmarks/links.py --config benchmarks/configs/links-nano.toml --rounds 3 --rate none
    sudo python benchmarks/links.py --config benchmarks/configs/links-nano.toml --rounds 2 --nat 1
    sudo python benchmarks/links.py --config benchmarks/configs/links-nano-nat.toml --peers 4 --nat 2 --rounds 4 \
        --wan 11.77 --relays 3       # NAT to NAT: through a circuit relay (docs/results/nat.md)
    sudo python benchmarks/links.py --config benchmarks/configs/links-56m.toml --rounds 2 --rate 80mbit \\
        --timeout 900 --out benchmarks/results/links-56m.json
    sudo python benchmarks/links.py --config benchmarks/configs/links-pipeline-tiny.toml --pipeline 2x2 \
        --rate 5mbit [--no-subspace]      # pipeline mode: S x R `join --stage K` peers, one host each

Per-peer link rates: ``rate * 10^(-X*u)``, u ~ U(0, 1) from ``--seed``, X = ``--rate-spread`` (the same
draw as ``locomm-peer simulate --heterogeneity X``: sim.network.NetworkModel.build's link speeds;
upload = download).

Output: one JSON object, printed as the last stdout line and written to ``--out``: the settings,
per peer its join summary (the last stdout line of ``join --json``; every key read with .get, so a
key the daemon does not write is null), its "round" and "exchange" log events verbatim, and its
link; then totals (exchanges, faults, bans, bytes, wall-clock, the share of compute wall-clock
spent waiting on the network, mean losses) and ``paths``: one row per partner payload that arrived
(receiver, sender, round, via push/pull, conn direct/relay, the pair's kind: open-open, open-nat, nat-nat),
from the peers' ``exchange`` events (``locomm/peer/transport/paths.py``), or their ``exchange path:`` log lines.
Needs root (netlab.available() says why not). Ctrl-C
or SIGTERM: the lab stops the peers (SIGINT, then SIGKILL after ``--grace``), deletes the
namespaces, and the partial JSON is still written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from locomm.config import ConfigError, RunSpec
from locomm.testing import netlab, netshape
from locomm.testing.launcher import Launcher, PeerExited

import _harness

REPO = _harness.REPO

SUMMARY_KEYS = (
    "rounds_completed",
    "initial_loss",
    "final_loss",
    "bytes_sent",
    "bytes_received",
    "exchanges_ok",
    "exchanges_failed",
    "wait_s",
    "faults",
    "banned",
    "banned_peers",
    "errors_answered",
    "first_heartbeat_s",
    "interrupted",
    "wall_s",
    "peer",
)
KEPT_EVENTS = ("round", "exchange")
STARTUP_TIMEOUT_S = 180.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _harness.parser(__doc__.split("\n\n")[0], out_help="Write the JSON here too")
    ap.add_argument("--config", required=True, help="Run spec (TOML); e.g. benchmarks/configs/links-nano.toml")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="80mbit", help="Link rate, up and down: 80mbit, 1gbit, ... or none")
    ap.add_argument(
        "--rate-spread",
        type=float,
        default=0.0,
        help="X: per-peer rate = rate * 10^(-X*u), u ~ U(0,1) (as simulate --heterogeneity)",
    )
    ap.add_argument("--nat", type=int, default=0, help="The last K peers sit behind a NAT router each")
    ap.add_argument(
        "--nat-reachability",
        choices=["private", "auto"],
        default="private",
        help="--reachability of the NATed peers' join (auto: AutoNAT decides, after a few dial-backs)",
    )
    ap.add_argument(
        "--open-reachability",
        choices=["public", "auto"],
        default="auto",
        help="--reachability of the open peers' join (public: they check their relay service at start)",
    )
    ap.add_argument(
        "--algo", choices=["noloco", "gasloc", "sparseloco", "diloco"], help="Override outer.algo of the config"
    )
    ap.add_argument("--island", type=int, default=0, help="The first K peers form one island (join --island)")
    ap.add_argument("--island-rate", default="1gbit", help="With --island: the rate among the island's members")
    ap.add_argument(
        "--island-together",
        action="store_true",
        help="With --island: start the other peers at once too (by default they start once the island formed)",
    )
    ap.add_argument("--relays", type=int, default=0, help="Bare circuit relays to start on the open hosts")
    ap.add_argument("--wan", default="10.77", help="First two octets of the lab's bridge subnet (11.77: public)")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the per-peer rate draw")
    ap.add_argument("--device", default="cpu", help="--device for every peer (default cpu)")
    ap.add_argument("--timeout", type=float, default=600.0, help="Stop the peers after this many seconds")
    ap.add_argument("--grace", type=float, default=30.0, help="Seconds peers get to exit after SIGINT")
    ap.add_argument(
        "--measure-links",
        action="store_true",
        help="Before starting peers, measure every link's TCP rate both ways (an extra host)",
    )
    ap.add_argument(
        "--peer-arg", action="append", default=[], help="Extra argument for every `join` (repeat; e.g. --peer-arg=-v)"
    )
    ap.add_argument("--keep", type=Path, help="Copy the peers' logs (jsonl, stdout, stderr) here")
    ap.add_argument("--quiet", action="store_true", help="No progress lines on stderr")
    ap.add_argument(
        "--pipeline",
        metavar="SxR",
        help="Pipeline mode: S stages x R replicas of `join --stage K` (one host each) train the "
        "config's train.steps through the stages (--peers and --rounds are not used)",
    )
    ap.add_argument("--steps", type=int, help="With --pipeline: train.steps of every stage-0 replica")
    ap.add_argument(
        "--no-subspace",
        action="store_true",
        help="With --pipeline: send h in the activation codec's casts, without the subspace",
    )
    args = ap.parse_args(argv)
    if args.pipeline:
        try:
            s, r = (int(x) for x in args.pipeline.lower().split("x"))
        except ValueError:
            ap.error(f"--pipeline: expected STAGESxREPLICAS, e.g. 2x2, got {args.pipeline!r}")
        if s < 2 or r < 1 or s * r > 16:
            ap.error(f"--pipeline: need 2+ stages, 1+ replicas, at most 16 peers; got {args.pipeline}")
        args.stages, args.replicas = s, r
        args.peers = s * r
    if not 2 <= args.peers <= 64:
        ap.error(f"--peers must be in [2, 64], got {args.peers}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not 0 <= args.nat < args.peers:
        ap.error(f"--nat must be in [0, {args.peers - 1}] (peer 0 starts the swarm and must be reachable)")
    if args.island and not (2 <= args.island <= args.peers - args.nat and not args.pipeline):
        ap.error(f"--island must be in [2, {args.peers - args.nat}] (open peers; not with --pipeline)")
    if args.island and (netlab.parse_rate(args.rate) is None or netlab.parse_rate(args.island_rate) is None):
        ap.error("--island: --rate and --island-rate must both be rates, not none")
    if not 0 <= args.rate_spread <= 3:
        ap.error("--rate-spread must be in [0, 3]")
    try:
        netlab.parse_rate(args.rate)
    except ValueError as e:
        ap.error(str(e))
    return args


def link_rates(n: int, rate: str, spread: float, seed: int) -> list[int | None]:
    bps = netlab.parse_rate(rate)
    if bps is None:
        return [None] * n
    if spread == 0:
        return [bps] * n
    from locomm.sim.network import NetworkModel  # noqa: PLC0415 - numpy

    net = NetworkModel.build(n, link_bps=float(bps), latency_s=0.0, heterogeneity=spread, step_s=1.0, seed=seed)
    return [int(b) for b in net.up_bps]


def param_count(spec: RunSpec) -> int:
    m = spec.model
    per_layer = 4 * m.d_model**2 + 3 * m.d_model * m.d_ff + 2 * m.d_model
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    return m.vocab_size * m.d_model + m.n_layers * per_layer + m.d_model + head


# ------------------------------------------------------------------------------------- reading


from locomm.cli.local_swarm import read_events  # noqa: E402 - one reader of the peers' JSON-lines logs


def last_json_line(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    for line in reversed(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def _count(x: Any) -> int | None:
    """A count from an int, a {peer: n} dict, or a list of peers; None when absent."""
    if x is None:
        return None
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, (int, float)):
        return int(x)
    if isinstance(x, dict):
        vals = list(x.values())
        return int(sum(vals)) if all(isinstance(v, (int, float)) for v in vals) else len(vals)
    if isinstance(x, (list, tuple, set)):
        return len(x)
    return None


def _sum(xs: list[Any]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return sum(xs) if xs else None


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


PATH_LINE = re.compile(r"exchange path: round=(\d+) peer=(\S+) via=(\w+) conn=(\w+)")


def read_paths(i: int, folder: Path, events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """How each partner payload reached peer ``i``: its ``exchange`` events, else its log lines."""
    keys = ("round", "peer", "via", "conn")
    ev = [{k: e.get(k) for k in keys} for e in events if e.get("event") == "exchange" and "via" in e]
    if ev:
        return ev, "events"
    err = folder / f"peer{i}.err"
    text = err.read_text(errors="replace") if err.exists() else ""
    rows = [dict(zip(keys, (int(m[1]), m[2], m[3], m[4]))) for m in PATH_LINE.finditer(text)]
    return rows, ("log" if rows else None)


def path_table(peers: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """One row per payload that arrived (receiver, sender, round, via, conn, pair), and counts per pair kind."""
    index = {p["peer_id"]: p["index"] for p in peers if p.get("peer_id")}
    nat = {p["index"]: p["nat"] for p in peers}
    rows, counts = [], {}
    for p in peers:
        for r in p.get("paths", []):
            j = index.get(r["peer"])
            kinds = sorted(("nat" if nat.get(x) else "open") for x in (p["index"], j))
            pair = "-".join(kinds[::-1] if kinds == ["nat", "open"] else kinds)
            rows.append({"receiver": p["index"], "sender": j, "round": r["round"], "via": r["via"], "conn": r["conn"]})
            rows[-1]["pair"] = pair
            c = counts.setdefault(pair, {})
            c[f"{r['via']}/{r['conn']}"] = c.get(f"{r['via']}/{r['conn']}", 0) + 1
    rows.sort(key=lambda r: (r["round"], r["receiver"], r["sender"] if r["sender"] is not None else -1))
    return rows, counts


def collect_peer(i: int, folder: Path, host: netlab.Host | None, proc: subprocess.Popen | None) -> dict[str, Any]:
    events = read_events(folder / f"peer{i}.jsonl")
    raw = last_json_line(folder / f"peer{i}.out")
    source = "stdout"
    if raw is None:  # killed before printing: the log's "finished" event holds the same summary
        raw = next((e for e in reversed(events) if e.get("event") == "finished"), None)
        source = "log" if raw is not None else None
    raw = raw or {}
    rounds = [e for e in events if e.get("event") == "round"]
    started = next((e for e in events if e.get("event") == "started"), {})
    walls = [e.get("wall_s") for e in rounds]
    round_s = [
        b - a for a, b in zip([0.0] + walls[:-1], walls) if isinstance(a, (int, float)) and isinstance(b, (int, float))
    ]
    peer: dict[str, Any] = {
        "index": i,
        "peer_id": raw.get("peer") or started.get("peer"),
        "host": host.name if host else None,
        "ip": host.ip if host else None,
        "public_ip": host.public_ip if host else None,
        "nat": bool(host and host.nat),
        "up_bps": host.up_bps if host else None,
        "down_bps": host.down_bps if host else None,
        "returncode": proc.returncode if proc is not None else None,
        "summary_source": source,
        "summary": {k: raw.get(k) for k in SUMMARY_KEYS},
        "extra_summary_keys": {k: v for k, v in raw.items() if k not in SUMMARY_KEYS and k != "event"},
        # the daemon's own wall-clock of training when it reports one (it includes the wait for the
        # last exchange, after the last round event), else the last round event's
        "train_wall_s": raw.get("wall_s")
        if isinstance(raw.get("wall_s"), (int, float))
        else (walls[-1] if walls else None),
        "round_s": round_s,
        "events": [e for e in events if e.get("event") in KEPT_EVENTS],
        "other_events": [e for e in events if e.get("event") not in KEPT_EVENTS + ("started",)],
    }
    peer["paths"], peer["paths_source"] = read_paths(i, folder, events)
    if proc is None or proc.returncode not in (0, None) or not raw:
        err = folder / f"peer{i}.err"
        peer["stderr_tail"] = err.read_text(errors="replace")[-3000:] if err.exists() else None
    return peer


def totals(peers: list[dict[str, Any]], wall_s: float | None) -> dict[str, Any]:
    s = [p["summary"] for p in peers]
    # wait_s from the summary, else (a peer killed early) from its last round event
    wait = [
        x.get("wait_s")
        if x.get("wait_s") is not None
        else next((e.get("wait_s") for e in reversed(p["events"]) if e.get("event") == "round"), None)
        for p, x in zip(peers, s)
    ]
    walls = [p["train_wall_s"] for p in peers]
    pairs = [(w, t) for w, t in zip(wait, walls) if isinstance(w, (int, float)) and isinstance(t, (int, float))]
    faults = [_count(x.get("faults")) for x in s]
    bans = [_count(x.get("banned")) if x.get("banned") is not None else _count(x.get("banned_peers")) for x in s]
    ok = _sum([x.get("exchanges_ok") for x in s])
    other: dict[str, float] = {}  # numeric summary keys this bench does not know (yet): summed as they are
    for p in peers:
        for k, v in p["extra_summary_keys"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                other[k] = other.get(k, 0) + v
    return {
        "peers_finished": sum(1 for x in s if x.get("rounds_completed") is not None),
        "rounds_completed_min": min(
            (x["rounds_completed"] for x in s if x.get("rounds_completed") is not None), default=None
        ),
        "exchanges_ok": ok,
        "exchanges_failed": _sum([x.get("exchanges_failed") for x in s]),
        "faults": _sum(faults),
        "bans": _sum(bans),
        "bytes_sent": _sum([x.get("bytes_sent") for x in s]),
        "bytes_received": _sum([x.get("bytes_received") for x in s]),
        "bytes_per_ok_exchange": (_sum([x.get("bytes_sent") for x in s]) or 0) / ok if ok else None,
        "wall_s": wall_s,
        "train_wall_s_sum": sum(t for _, t in pairs) if pairs else None,
        "wait_s_sum": sum(w for w, _ in pairs) if pairs else None,
        "wait_share": (sum(w for w, _ in pairs) / sum(t for _, t in pairs))
        if pairs and sum(t for _, t in pairs) > 0
        else None,
        "initial_loss_mean": _mean([x.get("initial_loss") for x in s]),
        "final_loss_mean": _mean([x.get("final_loss") for x in s]),
        "link_up_bps": [p["up_bps"] for p in peers],
        "link_down_bps": [p["down_bps"] for p in peers],
        "other_sums": other,
    }


# ------------------------------------------------------------------------------------- running


def log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def tcp_connections(host: netlab.Host) -> set[str]:
    """Established TCP connections in ``host``'s namespace, as 'local -> peer' (loopback left out)."""
    try:
        out = host.run(["ss", "-tnH", "state", "established"], check=False, timeout=10).stdout
    except Exception:  # noqa: BLE001 - a diagnostic only
        return set()
    pairs = set()
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and not f[2].startswith(("127.", "[::1]", "[::ffff:127.")):
            pairs.add(f"{f[2]} -> {f[3]}")
    return pairs


def start_relays(args: argparse.Namespace, hosts: list[netlab.Host], folder: Path, env: dict[str, str]) -> list[str]:
    """``--relays`` bare relays (locomm/testing/relay.py), round-robin on the open ``hosts``; their multiaddrs."""
    outs = []
    for k in range(args.relays):
        h, out = hosts[k % len(hosts)], folder / f"relay{k}.txt"
        cmd = [sys.executable, "-m", "locomm.testing.relay", "--host-maddr", f"/ip4/{h.ip}/tcp/0", "--out", str(out)]
        err = open(folder / f"relay{k}.err", "w")  # noqa: SIM115 - the child holds it; closed with the lab
        h.popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        outs.append((h, out))
    maddrs = []
    end = time.monotonic() + STARTUP_TIMEOUT_S
    for h, out in outs:
        while not out.exists():
            if time.monotonic() > end:
                raise RuntimeError(f"relay {out.stem} did not start: {(folder / (out.stem + '.err')).read_text()}")
            time.sleep(0.2)
        maddrs.append(next(m for m in out.read_text().split() if f"/{h.ip}/" in m))
        log(args, f"links: relay at {maddrs[-1]}")
    return maddrs


def run_bench(args: argparse.Namespace, spec: RunSpec, folder: Path, state: dict[str, Any]) -> None:
    n = args.peers
    spec_path = folder / "run.toml"
    spec.save(spec_path)
    rates = state["rates"]
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    with netlab.Lab(grace_s=args.grace, wan=args.wan) as lab, contextlib.ExitStack() as stack:
        hosts = [lab.add_host(f"p{i}", rate=rates[i], nat=i >= n - args.nat) for i in range(n)]
        state["hosts"] = hosts
        for h in hosts:
            log(args, f"links: {h}")
        relays = start_relays(args, [h for h in hosts if not h.nat], folder, env)
        state["relays"] = relays
        if args.island:
            netshape.shape_group(hosts[: args.island], args.island_rate)
            log(args, f"links: island p0..p{args.island - 1} at {args.island_rate} among themselves")
            if args.measure_links:  # the island's own links, both ways
                a, b = hosts[0], hosts[1]
                nbytes = int(min(64e6, max(4e6, netlab.parse_rate(args.island_rate) / 8)))
                state["measured_island"] = {
                    f"{x.name}->{y.name}": netlab.measure_tcp(x, y, nbytes) for x, y in ((a, b), (b, a))
                }
                log(args, f"links: island measured {state['measured_island']}")
        if args.measure_links:
            ref = lab.add_host("ref")
            measured = []
            for h in hosts:
                nbytes = int(min(8e6, max(1e6, (h.up_bps or 8e9) / 8 * 1.0)))
                up = netlab.measure_tcp(h, ref, nbytes)
                down = netlab.measure_tcp(ref, h, nbytes, dialer="dst" if h.nat else "src")
                measured.append({"up_bps": up, "down_bps": down})
                log(args, f"links: {h.name} measured up {up / 1e6:.1f} down {down / 1e6:.1f} Mbit/s")
            state["measured_links"] = measured

        # The launcher stops the peers first (SIGINT, --grace, SIGKILL to each group); the lab then
        # removes the namespaces and kills whatever is left inside them.
        peers = Launcher(folder, grace_s=args.grace, stop_signal=signal.SIGINT, threads=None, env=env, cwd=REPO)
        state["peers"] = peers
        stack.enter_context(peers)

        def launch(i: int, initial: str | None) -> subprocess.Popen:
            h = hosts[i]
            p = peers.start(
                f"peer{i}",
                "--until-round",
                str(args.rounds),
                "--shard",
                f"{i}/{n}",
                "--wait-for-peers",
                str(n),
                "--host-maddrs",
                f"/ip4/{h.ip}/tcp/0",
                "--json",
                *(["--reachability", args.nat_reachability] if h.nat else []),
                *(["--reachability", "public"] if not h.nat and args.open_reachability == "public" else []),
                *(a for r in ([initial, *relays] if h.nat and relays else []) for a in ("--relay", r)),
                *(["--island", "isl0", "--island-size", str(args.island)] if i < args.island else []),
                *args.peer_arg,
                config=spec_path,
                device=args.device,
                initial_peers=initial,
                announce=initial is None,
                spawn=h.popen,
            )
            return p.proc

        procs: list[subprocess.Popen] = state["procs"]
        state["t0"] = time.perf_counter()
        procs.append(launch(0, None))
        try:
            bootstrap = peers["peer0"].address(timeout=STARTUP_TIMEOUT_S, ip=hosts[0].ip)
        except (PeerExited, TimeoutError) as e:
            raise RuntimeError("peer 0 did not start:\n" + peers["peer0"].tail()) from e
        state["bootstrap"] = bootstrap
        log(args, f"links: peer 0 up at {bootstrap}")
        for i in range(1, n):
            if i == args.island and not args.island_together:
                wait_island_formed(args, folder, peers)
            procs.append(launch(i, bootstrap))
        seen = [0] * n
        conns: list[set[str]] = state["connections"]
        conns[:] = [set() for _ in range(n)]
        next_sample = 0.0
        end = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() >= next_sample:  # who is connected to whom (a NATed peer's are all outbound)
                next_sample = time.monotonic() + 5.0
                for i, h in enumerate(hosts):
                    conns[i] |= tcp_connections(h)
            if time.monotonic() > end:
                state["timed_out"] = True
                log(args, f"links: --timeout {args.timeout:g} s reached; stopping the peers")
                break
            for i in range(n):  # progress: one line per new round event
                ev = [e for e in read_events(folder / f"peer{i}.jsonl") if e.get("event") in KEPT_EVENTS]
                for e in ev[seen[i] :]:
                    if e.get("event") == "round":
                        log(
                            args,
                            f"[{time.perf_counter() - state['t0']:6.1f}s] peer {i} round {e.get('round')} "
                            f"loss {e.get('loss', float('nan')):.3f} answered {e.get('answered')} "
                            f"wait {e.get('wait_s', 0):.1f}s wall {e.get('wall_s', 0):.1f}s "
                            f"sent {e.get('bytes_sent', 0) / 1e6:.1f} MB",
                        )
                seen[i] = len(ev)
            time.sleep(0.5)
        # Leaving the with-block: the launcher sends SIGINT to every peer group, waits --grace, kills the
        # rest; then the lab removes its namespaces.
    state["t_end"] = time.perf_counter()


FORMED = re.compile(r"island isl0: \[.*\], representative")


def wait_island_formed(args: argparse.Namespace, folder: Path, peers: Launcher) -> None:
    """Until island member 0 logs the island formed: peers that start before it can begin round 0 without the
    island's representative (they count its members' heartbeats, whose rep flag is not set yet)."""
    end = time.monotonic() + STARTUP_TIMEOUT_S
    err = folder / "peer0.err"
    while not (err.exists() and FORMED.search(err.read_text(errors="replace"))):
        if time.monotonic() > end or peers["peer0"].proc.poll() is not None:
            raise RuntimeError("the island did not form:\n" + peers["peer0"].tail())
        time.sleep(0.2)
    log(args, "links: island formed; starting the other peers")


def boundary_stack(spec: RunSpec) -> str:
    """The codec stack a boundary really uses (without the subspace, its stage is dropped)."""
    from locomm.compression.choice import codec_choice  # noqa: PLC0415
    from locomm.model.stages import Geometry  # noqa: PLC0415

    return codec_choice("activation", spec.compression, boundary=Geometry.of(spec)).stack


def nat_args(args: argparse.Namespace, host: netlab.Host, cmd: list[str], relays: list[str]) -> list[str]:
    """A NATed stage peer's ``join`` gets ``--reachability`` and, with ``--relays``, its relays (+ its initial peer)."""
    if not host.nat:
        return cmd
    initial = [cmd[k + 1] for k, a in enumerate(cmd[:-1]) if a == "--initial-peers"]
    extra = [a for r in ([*initial, *relays] if relays else []) for a in ("--relay", r)]
    return [*cmd, "--reachability", args.nat_reachability, *extra]


def run_pipeline_bench(args: argparse.Namespace, spec: RunSpec) -> int:
    """S x R stage peers, one shaped host each; the pipeline swarm's summary plus the links."""
    from locomm.cli.local_swarm import run_pipeline_swarm  # noqa: PLC0415

    spec = spec.replace("pipeline", stages=args.stages, subspace=not args.no_subspace)
    if args.steps:
        spec = spec.replace("train", steps=args.steps)
    n = args.stages * args.replicas
    rates = link_rates(n, args.rate, args.rate_spread, args.seed)
    result: dict[str, Any] = {
        "bench": "links-pipeline",
        "config": str(args.config),
        "spec_hash": spec.hash(),
        "stages": args.stages,
        "replicas": args.replicas,
        "subspace": spec.pipeline.subspace,
        "k": spec.model.d_model // spec.compression.subspace_rate,
        "d_model": spec.model.d_model,
        "params": param_count(spec),
        "batch": [spec.data.batch_size, spec.data.seq_len],
        "micro_batch_size": spec.pipeline.micro_batch_size,
        "in_flight": spec.pipeline.in_flight,
        "activation_codec": boundary_stack(spec),
        "train_steps": spec.train.steps,
        "rate": args.rate,
        "rate_spread": args.rate_spread,
        "rates_bps": rates,
        "nat": args.nat,
        "wan": args.wan,
        "cpus": os.cpu_count(),
        "started_at": time.time(),
        "error": None,
    }
    code = 0
    try:
        with contextlib.ExitStack() as stack, netlab.Lab(grace_s=args.grace, wan=args.wan) as lab:
            hosts = [lab.add_host(f"p{i}", rate=rates[i], nat=i >= n - args.nat) for i in range(n)]
            for h in hosts:
                log(args, f"links: {h}")
            relay_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="locomm-relays-"))
            relays = start_relays(args, [h for h in hosts if not h.nat], Path(relay_dir), dict(os.environ))
            result["relays"] = relays
            summary = run_pipeline_swarm(
                spec,
                stages=args.stages,
                replicas=args.replicas,
                quiet=args.quiet,
                keep=args.keep,
                peer_args=("--device", args.device, *args.peer_arg),
                spawn=lambda i, cmd, **kw: hosts[i].popen(nat_args(args, hosts[i], list(cmd), relays), **kw),
                host_maddr=lambda i: f"/ip4/{hosts[i].ip}/tcp/0",
            )
        result.update(summary)
        if summary.get("failed_peers") or summary.get("interrupted"):
            code = 1
    except Exception as e:  # noqa: BLE001 - still write what we have
        result["error"] = f"{type(e).__name__}: {e}"
        code = 1
    result = {k: v for k, v in result.items() if k != "events"}
    if args.out:
        _harness.write_json(args.out, result, sort_keys=True, default=str)
    log(
        args,
        f"links: pipeline {args.pipeline} subspace={spec.pipeline.subspace} at {args.rate}: "
        f"{result.get('tokens_per_s')} tokens/s, loss {result.get('initial_loss')} -> {result.get('final_loss')}, "
        f"{result.get('bytes_per_token_per_boundary')} B/token/boundary, error {result['error']}",
    )
    print(json.dumps(result, sort_keys=True, default=str), flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = netlab.available(nat=args.nat > 0)
    if not ok:
        print(f"error: netlab unavailable: {why}", file=sys.stderr)
        return 2
    if args.pipeline:
        try:
            spec = RunSpec.load(args.config)
            if args.algo:
                spec = spec.replace("outer", algo=args.algo)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return run_pipeline_bench(args, spec)
    try:
        spec = RunSpec.load(args.config)
        if args.algo:
            spec = spec.replace("outer", algo=args.algo)
        if args.rounds * spec.outer.inner_steps > spec.train.steps:  # the LR schedule spans the run
            spec = spec.replace("train", steps=args.rounds * spec.outer.inner_steps)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rates = link_rates(args.peers, args.rate, args.rate_spread, args.seed)
    folder = Path(tempfile.mkdtemp(prefix="locomm-links-"))
    state: dict[str, Any] = {"procs": [], "hosts": [], "rates": rates, "connections": []}
    result: dict[str, Any] = {
        "bench": "links",
        "config": str(args.config),
        "spec_hash": spec.hash(),
        "algo": spec.outer.algo,
        "inner_steps": spec.outer.inner_steps,
        "params": param_count(spec),
        "batch": [spec.data.batch_size, spec.data.seq_len],
        "request_timeout_s": spec.network.request_timeout_s,
        "peers": args.peers,
        "rounds": args.rounds,
        "rate": args.rate,
        "rate_spread": args.rate_spread,
        "nat": args.nat,
        "island": args.island,
        "island_rate": args.island_rate if args.island else None,
        "island_together": bool(args.island and args.island_together),
        "seed": args.seed,
        "omp_threads": max(1, (os.cpu_count() or 1) // args.peers),
        "cpus": os.cpu_count(),
        "started_at": time.time(),
        "interrupted": False,
        "timed_out": False,
        "error": None,
    }
    code = 0
    try:
        run_bench(args, spec, folder, state)
    except (KeyboardInterrupt, SystemExit) as e:
        result["interrupted"] = True
        code = 130 if isinstance(e, KeyboardInterrupt) else (e.code if isinstance(e.code, int) else 1)
        log(args, "links: interrupted; the lab stopped the peers and removed its namespaces")
    except Exception as e:  # noqa: BLE001 - still write what we have
        result["error"] = f"{type(e).__name__}: {e}"
        code = 1
        log(args, f"links: error: {result['error']}")
    finally:
        result["timed_out"] = bool(state.get("timed_out"))
        result["bootstrap"] = state.get("bootstrap")
        result["relays"] = state.get("relays")
        result["wan"] = args.wan
        result["measured_links"] = state.get("measured_links")
        result["measured_island"] = state.get("measured_island")
        hosts, procs = state["hosts"], state["procs"]
        t0 = state.get("t0")
        wall = (state.get("t_end") or time.perf_counter()) - t0 if t0 is not None else None
        result["per_peer"] = [
            collect_peer(i, folder, hosts[i] if i < len(hosts) else None, procs[i] if i < len(procs) else None)
            for i in range(args.peers)
        ]
        for i, (p, r) in enumerate(zip(result["per_peer"], rates)):
            p["rate_bps"] = r
            c = state["connections"]
            p["tcp_connections"] = sorted(c[i]) if i < len(c) else []
        result["totals"] = totals(result["per_peer"], wall)
        result["paths"], result["path_counts"] = path_table(result["per_peer"])
        if args.keep:
            shutil.copytree(folder, args.keep, dirs_exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        text = json.dumps(result, sort_keys=True)
        if args.out:
            _harness.write_json(args.out, result, sort_keys=True)
        t = result["totals"]
        log(
            args,
            f"links: {t['peers_finished']}/{args.peers} peers finished, rounds>= {t['rounds_completed_min']}, "
            f"exchanges ok {t['exchanges_ok']} failed {t['exchanges_failed']}, "
            f"sent {(t['bytes_sent'] or 0) / 1e6:.1f} MB, wait share {t['wait_share']}, "
            f"loss {t['initial_loss_mean']} -> {t['final_loss_mean']}, wall {wall and round(wall, 1)} s",
        )
        print(text, flush=True)
    failed = [p["index"] for p in result["per_peer"] if p["returncode"] not in (0, None)]
    if code == 0 and (failed or result["timed_out"]):
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())

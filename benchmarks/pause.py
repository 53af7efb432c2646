"""Pause and resume in a swarm of real peers on shaped namespace links: does anyone wait for a paused peer?

Two runs of the same spec, each peer in its own network namespace (locomm/testing/netlab.py, tc tbf both ways):

- ``paused``: 3 peers; when every peer has reached round ``--pause-at``, peer 2 is paused
  (``locomm-peer pause --checkpoint-dir``, its control socket) and resumed ``--pause-rounds`` rounds of the
  others later (``locomm-peer resume``);
- ``two``: 2 peers, the same spec and shards 0/3 and 1/3 (the swarm the first two see while peer 2 is paused).

Figures, per run: each of peers 0 and 1's ``wait_s`` per round (compute waiting on the network, the difference
of consecutive ``round`` events' running sums) over the rounds from ``pause-at + 2`` (the pause is published and
read) to the resume, their mean and max; for ``paused``, also the rounds right after the pause (where a partner
may still have planned peer 2), the three rounds after the resume (the resumed peer downloads the swarm's state
from its donors, peers 0 and 1), peer 2's paused/resumed events and whether it took the swarm's state on resume.
Run it on a quiet machine: the two runs are sequential, so other load on the cores shifts one against the other;
``--two-first`` swaps their order (alternate it across repeats). Each run's window also reports its mean round
wall-clock and compute (wall less wait): a wait is the exchange's time past the compute's, so a run that
computed faster shows more wait for the same exchange.
The must-show: the mean wait per round while peer 2 is paused is no higher than in the 2-peer run.

    sudo python benchmarks/pause.py                       # ~4 minutes on 2 cores
    sudo python benchmarks/pause.py --rate 20mbit --config benchmarks/configs/links-nano.toml
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from locomm.config import RunSpec
from locomm.testing import netlab
from locomm.testing.launcher import Launcher

import _harness

REPO = _harness.REPO
CONFIG = REPO / "benchmarks" / "configs" / "links-nano.toml"
ROUND_KEYS = ("round", "wait_s", "answered", "peers", "wall_s", "compute_s", "tokens_per_s", "time")
"""What the result keeps of each round event."""


def control(cmd: str, directory: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", cmd, "--checkpoint-dir", str(directory), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return {"rc": out.returncode, **(json.loads(lines[-1]) if lines else {"stderr": out.stderr[-500:]})}


def waits(events: list[dict[str, Any]], key: str = "wait_s") -> dict[int, float]:
    """Per round: the difference of consecutive ``round`` events' running ``key`` (``wait_s``, ``wall_s``)."""
    total = {e["round"]: e[key] for e in events if e.get("event") == "round"}
    return {r: total[r] - total[r - 1] for r in sorted(total) if r - 1 in total}


def run(args: Any, spec_path: Path, n: int, folder: Path) -> dict[str, Any]:
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    out: dict[str, Any] = {"peers": n}
    t0 = time.perf_counter()
    with netlab.Lab(grace_s=10.0) as lab, contextlib.ExitStack() as stack:
        hosts = [lab.add_host(f"p{i}", rate=args.rate) for i in range(n)]
        peers = stack.enter_context(
            Launcher(folder, grace_s=10.0, stop_signal=signal.SIGINT, threads=None, env=env, cwd=REPO)
        )
        dirs = [folder / f"c{i}" for i in range(n)]
        procs = []
        for i in range(n):
            initial = None if i == 0 else peers["peer0"].address(ip=hosts[0].ip)
            procs.append(
                peers.start(
                    f"peer{i}",
                    *("--until-round", str(args.rounds), "--shard", f"{i}/3", "--wait-for-peers", str(n)),
                    *("--checkpoint-dir", str(dirs[i]), "--host-maddrs", f"/ip4/{hosts[i].ip}/tcp/0"),
                    *("--eval-every", "0"),
                    config=spec_path,
                    initial_peers=initial,
                    announce=i == 0,
                    spawn=hosts[i].popen,
                )
            )
        deadline = time.monotonic() + args.timeout

        def wait_for(cond, what: str) -> None:
            while not cond():
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"{what}: " + "".join(p.tail(1500) for p in procs))
                time.sleep(0.3)

        if n == 3:
            wait_for(lambda: min(p.round() for p in procs) >= args.pause_at, "all reach --pause-at")
            out["pause"] = control("pause", dirs[2])
            out["paused_wall_s"] = time.perf_counter() - t0
            resume_at = max(p.round() for p in procs[:2]) + args.pause_rounds
            wait_for(lambda: min(p.round() for p in procs[:2]) >= resume_at, "the others go on")
            out["resume_asked_at"] = time.time()  # the window ends here: the resume's state sync is not a pause
            out["resume"] = control("resume", dirs[2])
            out["resumed_wall_s"] = time.perf_counter() - t0
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                out["timed_out"] = True
                break
            time.sleep(0.5)
        out["exit_codes"] = [p.poll() for p in procs]
        out["events"] = {p.name: p.events() for p in procs}
    out["wall_s"] = time.perf_counter() - t0
    return out


def figures(paused: dict[str, Any], two: dict[str, Any], pause_at: int) -> dict[str, Any]:
    ev = paused["events"]
    p2 = ev["peer2"]
    pe = next((e for e in p2 if e["event"] == "paused"), None)
    re_ = next((e for e in p2 if e["event"] == "resumed"), None)
    out: dict[str, Any] = {"paused_event": pe, "resumed_event": re_, "window": {}, "resume_sync_wait_s": {}}
    while_paused, just_after, two_peers = [], [], []
    # A round's wall-clock beside its wait: wait = the exchange's time past the compute's, so a run whose compute
    # was faster (another load on the 2 cores during the other run) shows more wait for the same exchange.
    walls: dict[str, list[float]] = {"while_paused": [], "two_peers": []}
    for name in ("peer0", "peer1"):
        w, w2 = waits(ev[name]), waits(two["events"][name])
        r1, r2 = waits(ev[name], "wall_s"), waits(two["events"][name], "wall_s")
        rounds = [e for e in ev[name] if e["event"] == "round"]
        # The rounds peer 2 was paused through: from two rounds after the one this peer was in when the pause
        # was published (every peer has read it by then) to the one it was in at the resume.
        at = lambda t: max((e["round"] for e in rounds if e["time"] <= t), default=0)  # noqa: E731
        lo = at(pe["time"]) + 2 if pe else pause_at + 2
        hi = at(paused["resume_asked_at"]) if "resume_asked_at" in paused else lo
        out["window"][name] = [lo, hi]
        while_paused += [w[r] for r in range(lo, hi + 1) if r in w]
        just_after += [w[r] for r in range(lo - 2, lo) if r in w]
        two_peers += [w2[r] for r in range(lo, hi + 1) if r in w2]
        walls["while_paused"] += [r1[r] for r in range(lo, hi + 1) if r in r1]
        walls["two_peers"] += [r2[r] for r in range(lo, hi + 1) if r in r2]
        # What the resumed peer's state download (from us, among its donors) cost us: the rounds after the resume.
        out["resume_sync_wait_s"][name] = [round(w[r], 3) for r in range(hi + 1, hi + 4) if r in w]
    for key, xs in (("while_paused", while_paused), ("just_after_pause", just_after), ("two_peers", two_peers)):
        out[key] = {
            "n": len(xs),
            "mean_s": statistics.fmean(xs) if xs else None,
            "max_s": max(xs) if xs else None,
            "per_round_s": [round(x, 3) for x in xs],
        }
    for key, xs in walls.items():
        out[key]["round_wall_mean_s"] = statistics.fmean(xs) if xs else None
        m = out[key]["mean_s"]
        out[key]["compute_mean_s"] = statistics.fmean(xs) - m if xs and m is not None else None
    out["synced_on_resume"] = any(e["event"] == "synced" for e in p2)
    out["finished_rounds"] = {
        name: next((e["rounds_completed"] for e in es if e["event"] == "finished"), None) for name, es in ev.items()
    }
    m, m2 = out["while_paused"]["mean_s"], out["two_peers"]["mean_s"]
    out["no_higher_than_two_peers"] = None if m is None or m2 is None else m <= m2
    return out


def main(argv: list[str] | None = None) -> int:
    ap = _harness.parser(__doc__, out="pause.json")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--rate", default="80mbit", help="Every link's rate, up and down (none: unshaped)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner-steps", type=int, help="Override the config's H")
    ap.add_argument("--pause-at", type=int, default=5)
    ap.add_argument("--pause-rounds", type=int, default=8, help="Rounds the others train while peer 2 is paused")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--two-first", action="store_true", help="Run the 2-peer swarm first (alternate across repeats)")
    args = ap.parse_args(argv)
    ok, why = netlab.available()
    if not ok:
        print(f"pause: skipped: {why}", file=sys.stderr)
        return 0
    spec = RunSpec.load(args.config)
    if args.inner_steps:
        spec = spec.replace("outer", inner_steps=args.inner_steps)
    spec = spec.replace("train", steps=max(spec.train.steps, args.rounds * spec.outer.inner_steps))
    result: dict[str, Any] = {
        "config": str(args.config),
        "rate": args.rate,
        "rounds": args.rounds,
        "order": "two, paused" if args.two_first else "paused, two",
    }
    with tempfile.TemporaryDirectory(prefix="locomm-pause-") as tmp:
        spec_path = Path(tmp) / "run.toml"
        spec.save(spec_path)
        if args.two_first:  # the other order: the machine's drift between the two runs then falls the other way
            two = run(args, spec_path, 2, Path(tmp) / "two")
            paused = run(args, spec_path, 3, Path(tmp) / "paused")
        else:
            paused = run(args, spec_path, 3, Path(tmp) / "paused")
            two = run(args, spec_path, 2, Path(tmp) / "two")
    result["figures"] = figures(paused, two, args.pause_at)
    result["runs"] = {
        "paused": {k: v for k, v in paused.items() if k != "events"},
        "two": {k: v for k, v in two.items() if k != "events"},
    }
    result["rounds_events"] = {
        run_name: {
            name: [{k: e.get(k) for k in ROUND_KEYS} for e in es if e["event"] == "round"]
            for name, es in r["events"].items()
        }
        for run_name, r in (("paused", paused), ("two", two))
    }
    _harness.write_json(args.out, result)
    print(json.dumps(result["figures"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

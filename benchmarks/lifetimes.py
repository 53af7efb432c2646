"""Lifetimes: no process outlives its launcher, whatever signal it gets and whenever it gets it.

    .venv/bin/python benchmarks/lifetimes.py [--resume] [--only dp-sigkill-3,diloco-peer-sigkill]

Each cell starts ``locomm-peer swarm`` (data-parallel ``--peers 2 --rounds 50``, or ``--pipeline 2x2
--rounds 50``; nano, a 1 MB corpus) with an environment marker of its own and a TMPDIR of its own, and
sends the launcher a signal ``at_s`` seconds after its start (``up``: 3 s after every peer's p2pd is up).
Then it polls every 0.2 s for 15 s: how many live processes still carry the marker (launcher, reaper,
peers, p2pd, DiLoCo's forked DHT/averager; zombies do not count) and whether a ``locomm-*`` folder is
left in TMPDIR. Whatever is still alive after that is SIGKILLed by the script (and counted).
``diloco-peer-sigkill`` SIGKILLs one DiLoCo peer of a running 2-peer swarm once its DHT and averager
children are up, and counts its descendants (forked helpers and both p2pd) alive 15 s later; then it
stops the launcher with SIGINT and checks as above.

Results: benchmarks/results/lifetimes.json (one entry per cell, written after each), and a table.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from locomm.config import RunSpec
from locomm.peer.lifeline import marked
from locomm.testing import procs
from locomm.testing.procs import cmdline

import _harness

MARK = "LOCOMM_LIFETIME_BENCH"
WINDOW_S = 15.0
MODES = {
    "dp": ["--peers", "2", "--rounds", "50"],
    "pipe": ["--pipeline", "2x2", "--rounds", "50"],
}
EVENTS = [("sigint", 2), ("sigint", 6), ("sigint", 12), ("sigterm", 6), ("sighup", 6), ("sigkill", 3), ("sigkill", 12)]
# "up": 3 s after every peer's p2pd is up (on a busy machine 12 s can still be the launcher's start-up).
UP = [("sigint", "up"), ("sighup", "up"), ("sigkill", "up")]
SIZE = {"dp": 2, "pipe": 4}
CELLS = {f"{m}-{s}-{t}": (m, s, t) for m in MODES for s, t in EVENTS + UP}
CELLS["diloco-peer-sigkill"] = ("dp", "peer", 0)


def kinds(token: str, launcher: int) -> dict[str, int]:
    """The marked processes, by kind."""
    table = procs.table()
    pids = [p for p in marked(token, name=MARK) if p in table]
    joins = {p for p in pids if " join " in cmdline(p)}
    peers = {p for p in joins if table[p].ppid not in joins}  # a fork of a peer has the same command line
    out = {"launcher": 0, "reaper": 0, "peer": 0, "helper": 0, "p2pd": 0, "other": 0}
    for p in pids:
        if p == launcher:
            out["launcher"] += 1
        elif table[p].comm == "p2pd":
            out["p2pd"] += 1
        elif "locomm.peer.lifeline" in cmdline(p):
            out["reaper"] += 1
        elif p in peers:
            out["peer"] += 1
        elif table[p].ppid in peers:
            out["helper"] += 1  # a fork of a peer (DiLoCo's hivemind.DHT, DecentralizedAverager)
        else:
            out["other"] += 1
    return out


def kill_all(token: str) -> int:
    pids = marked(token, name=MARK)
    for p in pids:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(p), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return len(pids)


def folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("locomm-"))


def watch(token: str, tmp: Path, launcher: subprocess.Popen) -> dict[str, Any]:
    """Poll for :data:`WINDOW_S`: when every marked process was gone, what was left at the end."""
    t0 = time.monotonic()
    gone_s = launcher_s = None
    while time.monotonic() - t0 < WINDOW_S:
        if launcher_s is None and launcher.poll() is not None:
            launcher_s = time.monotonic() - t0
        if not marked(token, name=MARK) and not folders(tmp):
            gone_s = time.monotonic() - t0
            launcher_s = gone_s if launcher_s is None else launcher_s
            break
        time.sleep(0.2)
    left = kinds(token, launcher.pid)
    return {
        "all_gone_s": None if gone_s is None else round(gone_s, 2),
        "launcher_exit_s": None if launcher_s is None else round(launcher_s, 2),
        "left_at_15s": {k: v for k, v in left.items() if v},
        "folders_left": folders(tmp),
    }


def run_cell(name: str, root: Path) -> dict[str, Any]:
    mode, sig, at_s = CELLS[name]
    token = uuid.uuid4().hex
    cell = Path(tempfile.mkdtemp(prefix="c", dir=root))  # short: TMPDIR below it must fit socket paths
    tmp = cell / "tmp"
    tmp.mkdir()
    spec = RunSpec.preset("nano").replace("data", batch_size=8, seq_len=64, max_corpus_mb=1.0)
    spec.save(cell / "run.toml")
    env = {**os.environ, MARK: token, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "locomm.cli.main", "swarm", *MODES[mode], "--config", str(cell / "run.toml")]
    cmd += ["--json", "--plot", str(cell / "plot.png"), "--algo", "diloco" if sig == "peer" else "noloco"]
    err = open(cell / "launcher.err", "w")  # noqa: SIM115 - closed below
    t0 = time.monotonic()
    launcher = subprocess.Popen(
        cmd, env=env, cwd=cell, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
    )
    out: dict[str, Any] = {"mode": mode, "signal": sig, "at_s": at_s, "command": " ".join(cmd[2:])}
    try:
        if sig == "peer":
            try:
                out |= diloco_peer(token, launcher)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\n{(cell / 'launcher.err').read_text()[-3000:]}") from None
            sig, out["then"] = "sigint", "SIGINT to the launcher"
        elif at_s == "up":
            deadline = time.monotonic() + 180
            while kinds(token, launcher.pid)["p2pd"] < SIZE[mode] and time.monotonic() < deadline:
                time.sleep(0.2)
            out["up_after_s"] = round(time.monotonic() - t0, 1)
            time.sleep(3)
        else:
            while time.monotonic() - t0 < at_s and launcher.poll() is None:
                time.sleep(0.05)
        out["at_signal"] = {k: v for k, v in kinds(token, launcher.pid).items() if v}
        os.kill(launcher.pid, getattr(signal, sig.upper()))
        out |= watch(token, tmp, launcher)
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.wait(timeout=30)
        out["launcher_rc"] = launcher.returncode
        out["traceback"] = "Traceback" in (cell / "launcher.err").read_text()
    finally:
        out["killed_by_bench"] = kill_all(token)
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        err.close()
    out["ok"] = not out["left_at_15s"] and not out["folders_left"] and out.get("peer_left_at_15s", 0) == 0
    return out


def diloco_peer(token: str, launcher: subprocess.Popen) -> dict[str, Any]:
    """SIGKILL a DiLoCo peer once its forked helpers and both p2pd run; its descendants 15 s later."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and launcher.poll() is None:
        table = procs.table()
        ours = [p for p in marked(token, name=MARK) if p in table and table[p].ppid == launcher.pid]
        peers = [p for p in ours if " join " in cmdline(p)]
        for p in peers:
            below = procs.descendants(p)
            kids, names = set(below), [k.comm for k in below.values()]
            if names.count("p2pd") >= 2 and names.count("python") >= 2:  # its own and the DHT's; DHT, averager
                os.kill(p, signal.SIGKILL)
                t0 = time.monotonic()
                while time.monotonic() - t0 < WINDOW_S and kids & set(procs.table()):
                    time.sleep(0.2)
                left = kids & set(procs.table())
                return {
                    "peer_descendants": sorted(names),
                    "peer_descendants_gone_s": None if left else round(time.monotonic() - t0, 2),
                    "peer_left_at_15s": len(left),
                }
        time.sleep(0.3)
    raise RuntimeError(f"no DiLoCo peer with its DHT, averager and two p2pd in 180 s (launcher: {launcher.poll()})")


def print_table(entries: dict[str, Any]) -> None:
    head = f"{'cell':<22} {'at signal':<28} {'rc':>4} {'tb':>3} {'launcher':>8} {'all gone':>8}  left@15s  folders"
    print(head)
    for name, r in entries.items():
        at = ",".join(f"{k}={v}" for k, v in r.get("at_signal", {}).items())
        gone = "-" if r["all_gone_s"] is None else f"{r['all_gone_s']:.1f}s"
        exit_s = "-" if r["launcher_exit_s"] is None else f"{r['launcher_exit_s']:.1f}s"
        left = ",".join(f"{k}={v}" for k, v in r["left_at_15s"].items()) or "0"
        print(
            f"{name:<22} {at:<28} {r['launcher_rc']!s:>4} {'y' if r['traceback'] else 'n':>3} {exit_s:>8} "
            f"{gone:>8}  {left:<8}  {len(r['folders_left'])}"
        )
        if "peer_left_at_15s" in r:
            print(
                f"{'':<22} SIGKILLed peer's descendants {r['peer_descendants']}: "
                f"{r['peer_left_at_15s']} left at 15 s (gone in {r['peer_descendants_gone_s']} s)"
            )


def main() -> None:
    ap = _harness.parser(__doc__, out="lifetimes.json", resume=True)
    ap.add_argument("--only", help="Comma-separated cell names (default: all of them)")
    args = ap.parse_args()
    # A shell's background job ignores SIGINT, nohup SIGHUP, and the launchers would inherit (and honour)
    # that: give them the defaults.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    done = _harness.Entries(args.out, resume=args.resume, window_s=WINDOW_S)
    names = args.only.split(",") if args.only else list(CELLS)
    with tempfile.TemporaryDirectory(prefix="lt-") as root:
        for name in names:
            if name in done:
                continue
            r = run_cell(name, Path(root))
            done.add(name, r)
            print(f"{name}: {'ok' if r['ok'] else 'FAIL'} {r}", flush=True)
    print_table({n: done[n] for n in CELLS if n in done})


if __name__ == "__main__":
    main()

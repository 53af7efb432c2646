"""`locomm-peer swarm`: N real peer processes on loopback, a live table, a clean stop, a summary.

Each peer is a `locomm-peer join` process in its own process group (so its p2pd
child goes with it), writing JSON-lines events to a temporary folder that this
launcher tails for the live table. The first peer starts the swarm; the others
join through its multiaddr, all with the same run spec file (so each verifies the
swarm's spec hash). On Ctrl-C every peer gets SIGINT (they finish the step,
checkpoint and shut P2P down), then anything left is killed; the temporary
folder is removed either way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from locomm.config import RunSpec

STARTUP_TIMEOUT_S = 90.0


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written, or a killed writer's last one
        if isinstance(e, dict):
            out.append(e)
    return out


def peer_rows(folder: Path, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        ev = read_events(folder / f"peer{i}.jsonl")
        last_round = next((e for e in reversed(ev) if e["event"] == "round"), {})
        started = next((e for e in ev if e["event"] == "started"), {})
        finished = next((e for e in ev if e["event"] == "finished"), None)
        rows.append(
            {
                "peer": i,
                "id": started.get("peer", "")[-8:],
                "round": last_round.get("round", 0),
                "loss": last_round.get("loss"),
                "val_loss": last_round.get("val_loss"),
                "tokens_per_s": last_round.get("tokens_per_s"),
                "bytes_sent": last_round.get("bytes_sent", 0),
                "answered": last_round.get("answered"),
                "state": "done" if finished else ("training" if started else "starting"),
                "events": ev,
            }
        )
    return rows


def table(rows: list[dict[str, Any]], rounds: int) -> Table:
    t = Table(title=f"locomm swarm: {len(rows)} peers, {rounds} rounds")
    for col in ("peer", "id", "state", "round", "loss", "val", "tok/s", "MB sent", "got"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["peer"]),
            r["id"],
            r["state"],
            f"{r['round']}/{rounds}",
            _f(r["loss"]),
            _f(r["val_loss"]),
            _f(r["tokens_per_s"], "{:,.0f}"),
            f"{r['bytes_sent'] / 1e6:.1f}",
            str(r["answered"] or "-"),
        )
    return t


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # whatever is left in each group (a peer that hung, its p2pd)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def max_weight_distance(files: list[Path]) -> float:
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    flats = []
    for f in files:
        if f.exists():
            w = load_file(str(f))
            flats.append(torch.cat([w[k].flatten() for k in sorted(w)]))
    return max((float((a - b).norm()) for i, a in enumerate(flats) for b in flats[i + 1 :]), default=float("nan"))


def run_swarm(
    spec: RunSpec,
    *,
    peers: int,
    rounds: int,
    quiet: bool,
    plot: Path | None,
    keep: Path | None = None,
    peer_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    console = Console(stderr=True)
    folder = Path(tempfile.mkdtemp(prefix="locomm-swarm-"))
    spec_path = folder / "run.toml"
    spec.save(spec_path)
    procs: list[subprocess.Popen] = []
    errs = []
    interrupted = False
    t0 = time.perf_counter()

    def launch(i: int, initial: str | None) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "join",
            "--config",
            str(spec_path),
            "--until-round",
            str(rounds),
            "--log-file",
            str(folder / f"peer{i}.jsonl"),
            "--final-weights",
            str(folder / f"peer{i}.safetensors"),
            "--shard",
            f"{i}/{peers}",
            "--checkpoint-dir",
            str(folder / f"ckpt{i}"),
            "--wait-for-peers",
            str(peers),
            *peer_args,
        ]
        if initial:
            cmd += ["--initial-peers", initial]
        else:
            cmd += ["--announce-file", str(folder / "peer0.addr")]
        err = open(folder / f"peer{i}.err", "w")  # noqa: SIM115 - closed below
        errs.append(err)
        # Share the cores instead of every peer's torch grabbing all of them.
        threads = str(max(1, (os.cpu_count() or 1) // peers))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        return subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )

    # Ctrl-C (or SIGTERM) only sets a flag that every wait below checks: a KeyboardInterrupt raised at an
    # arbitrary point could leave a peer started but not yet in ``procs`` (never stopped), or interrupt
    # rich's Live while it holds its lock (its refresh thread then never ends and the launcher hangs).
    stop_requested = threading.Event()
    old_handlers = {sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        procs.append(launch(0, None))
        addr_file = folder / "peer0.addr"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (not addr_file.exists() or not addr_file.read_text().strip()) and not stop_requested.is_set():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the first peer did not start:\n" + (folder / "peer0.err").read_text()[-2000:])
            stop_requested.wait(0.1)
        if not stop_requested.is_set():
            bootstrap = addr_file.read_text().split()[0]
            for i in range(1, peers):
                if stop_requested.is_set():
                    break
                procs.append(launch(i, bootstrap))
        if not stop_requested.is_set():
            with (
                Live(table(peer_rows(folder, peers), rounds), console=console, refresh_per_second=2, transient=False)
                if not quiet
                else _NoLive() as live
            ):
                while any(p.poll() is None for p in procs) and not stop_requested.is_set():
                    live.update(table(peer_rows(folder, peers), rounds))
                    stop_requested.wait(0.5)
                live.update(table(peer_rows(folder, peers), rounds))
        if stop_requested.is_set():
            interrupted = True
            console.print("stopping the swarm (Ctrl-C)...")
    finally:
        _stop(procs, grace_s=20.0)
        for e in errs:
            e.close()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    try:
        rows = peer_rows(folder, peers)
        failed = [i for i, p in enumerate(procs) if p.returncode not in (0, None) and not interrupted]
        for i in failed:
            console.print(
                f"[red]peer {i} exited with {procs[i].returncode}:[/]\n" + (folder / f"peer{i}.err").read_text()[-1500:]
            )
        finals = [next((e for e in r["events"] if e["event"] == "finished"), None) for r in rows]
        done = [f for f in finals if f]
        summary = {
            "peers": peers,
            "rounds": rounds,
            "rounds_completed": min((f["rounds_completed"] for f in done), default=0)
            if len(done) == peers
            else min((r["round"] for r in rows), default=0),
            "initial_loss": _mean([f["initial_loss"] for f in done]),
            "final_loss": _mean([f["final_loss"] for f in done]),
            "bytes_sent": sum(f["bytes_sent"] for f in done),
            "max_weight_distance": max_weight_distance([folder / f"peer{i}.safetensors" for i in range(peers)]),
            "wait_fraction": _mean([f["wait_s"] / max(1e-9, _wall(r["events"])) for f, r in zip(finals, rows) if f]),
            "first_heartbeat_s": max((f["first_heartbeat_s"] for f in done), default=None),
            "wall_s": time.perf_counter() - t0,
            "interrupted": interrupted,
            "failed_peers": failed,
        }
        if plot is not None:
            write_swarm_plot(plot, rows)
            summary["plot"] = str(plot)
        if keep is not None:
            shutil.copytree(folder, keep, dirs_exist_ok=True)
        if not quiet:
            console.print()
            console.print(
                f"swarm: {summary['rounds_completed']}/{rounds} rounds, loss {summary['initial_loss']:.3f} -> "
                f"{summary['final_loss']:.3f}, {summary['bytes_sent'] / 1e6:.1f} MB sent, "
                f"max weight distance {summary['max_weight_distance']:.4f}" + (f", plot {plot}" if plot else "")
            )
        return summary
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wall(events: list[dict[str, Any]]) -> float:
    rounds = [e for e in events if e["event"] == "round"]
    return rounds[-1]["wall_s"] if rounds else 0.0


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, *_: Any) -> None:
        return None


def write_swarm_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        pts = [(e["round"], e["loss"]) for e in r["events"] if e["event"] == "round"]
        if pts:
            ax.plot(*zip(*pts), marker=".", label=f"peer {r['peer']} train")
        vals = [(e["round"], e["val_loss"]) for e in r["events"] if e["event"] in ("eval",)]
        fin = [e for e in r["events"] if e["event"] == "finished"]
        if vals and fin:
            vals.append((fin[0]["rounds_completed"], fin[0]["final_loss"]))
            ax.plot(*zip(*vals), linestyle="--", marker="o", label=f"peer {r['peer']} val")
    ax.set_xlabel("round")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

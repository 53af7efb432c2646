"""`locomm-peer swarm --pipeline SxR`: S stages x R replicas of real peers on loopback, a live table per stage.

Each peer is a `locomm-peer join --stage K` process in its own process group (its p2pd
child goes with it), logging JSON lines to a temporary folder this launcher tails. The
first peer (stage 0) starts the swarm and the others join through its multiaddr. Stage-0
replicas train ``train.steps`` optimizer steps; the other stages serve until every
stage-0 replica has finished. The summary adds up what the peers report: losses (stage 0,
through the whole pipeline), lost and re-routed micro-batches, bytes per token per
boundary, and the bubble fraction from the peers' compute timestamps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from locomm.cli.local_swarm import STARTUP_TIMEOUT_S, _mean, _NoLive, _stop, read_events
from locomm.config import RunSpec


def stage_rows(folder: Path, n: int, replicas: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        ev = read_events(folder / f"peer{i}.jsonl")
        started = next((e for e in ev if e["event"] == "started"), {})
        finished = next((e for e in ev if e["event"] == "finished"), None)
        last = next((e for e in reversed(ev) if e["event"] == "step"), {})
        rows.append(
            {
                "peer": i,
                "stage": started.get("stage", i // replicas),
                "id": started.get("peer", "")[-8:],
                "state": "done" if finished else ("serving" if started else "starting"),
                "step": (finished or last).get("step", 0),
                "loss": last.get("loss"),
                "lost": (finished or last).get("microbatches_lost", last.get("lost", 0)),
                "rerouted": (finished or last).get("microbatches_rerouted", last.get("rerouted", 0)),
                "finished": finished,
                "events": ev,
            }
        )
    return rows


def table(rows: list[dict[str, Any]], stages: int, steps: int) -> Table:
    t = Table(title=f"locomm pipeline: {stages} stages, {len(rows) // max(1, stages)} replicas each, {steps} steps")
    for col in ("stage", "peer", "id", "state", "step", "loss", "lost", "re-routed"):
        t.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["stage"], r["peer"])):
        t.add_row(
            str(r["stage"]),
            str(r["peer"]),
            r["id"],
            r["state"],
            f"{r['step']}/{steps}",
            f"{r['loss']:.3f}" if isinstance(r["loss"], (int, float)) else "-",
            str(r["lost"]),
            str(r["rerouted"]),
        )
    return t


def timeline_stats(finals: list[dict[str, Any]], stages: int) -> dict[str, Any]:
    """Bubble fraction and per-stage overlap share from the peers' compute timestamps (one machine's clock)."""
    from locomm.sim.pipeline import overlap_by_stage  # noqa: PLC0415

    drivers = [f for f in finals if f["stage"] == 0 and f["compute_intervals"]]
    if not drivers:
        return {}
    t0 = min(iv[0] for f in drivers for iv in f["compute_intervals"])
    t1 = max(iv[1] for f in drivers for iv in f["compute_intervals"])
    span = max(1e-9, t1 - t0)
    busy = 0.0
    intervals = []
    for f in finals:
        for a, b, _kind in f["compute_intervals"]:
            a, b = max(a, t0), min(b, t1)
            if b > a:
                busy += b - a
                intervals.append((a, b, f["stage"]))
    return {
        "bubble_fraction": 1.0 - busy / (len(finals) * span),
        "train_span_s": span,
        "stage_overlap_share": {str(s): v for s, v in overlap_by_stage(intervals, stages).items()},
    }


def run_pipeline_swarm(
    spec: RunSpec,
    *,
    stages: int,
    replicas: int,
    quiet: bool,
    keep: Path | None = None,
    kill_at_step: int | None = None,
    join_auto_at_step: int | None = None,
    bootstrap_file: Path | None = None,
    peer_args: tuple[str, ...] = (),
    spawn: Callable[..., subprocess.Popen] | None = None,
    host_maddr: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """Run S x R peers to the end of ``spec.train.steps``; optionally kill one stage-1 replica at a step
    and start a ``--stage auto`` joiner at another (resilience). ``bootstrap_file`` receives the first
    peer's multiaddr once it is up (for a test or a `status` call beside the run).

    ``spawn(i, argv, **popen_kw)`` starts peer ``i`` (default: a local process in its own session; the
    link bench starts each in its network namespace) and ``host_maddr(i)`` is its ``--host-maddrs``
    (default: loopback, any port)."""
    console = Console(stderr=True)
    folder = Path(tempfile.mkdtemp(prefix="locomm-pipe-"))
    spec_path = folder / "run.toml"
    spec = spec.replace("pipeline", stages=stages)
    spec.save(spec_path)
    n = stages * replicas
    procs: list[subprocess.Popen] = []
    errs = []
    t0 = time.perf_counter()
    killed: list[int] = []

    def launch(i: int, stage: str, initial: str | None) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "join",
            "--config",
            str(spec_path),
            "--stage",
            stage,
            "--log-file",
            str(folder / f"peer{i}.jsonl"),
            "--shard",
            f"{i % replicas}/{replicas}",
            "--wait-for-peers",
            str(n),
            "-q",
            *peer_args,
        ]
        if host_maddr is not None:
            cmd += ["--host-maddrs", host_maddr(i)]
        cmd += ["--announce-file", str(folder / f"peer{i}.addr")] + (["--initial-peers", initial] if initial else [])
        err = open(folder / f"peer{i}.err", "w")  # noqa: SIM115 - closed below
        errs.append(err)
        threads = str(max(1, (os.cpu_count() or 1) // n))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        kw = dict(stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=env)
        if spawn is not None:
            return spawn(i, cmd, **kw)
        return subprocess.Popen(cmd, start_new_session=True, **kw)

    stop_requested = threading.Event()
    main = threading.current_thread() is threading.main_thread()  # a test may run the launcher in a thread
    old = (
        {sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        if main
        else {}
    )
    interrupted = False
    try:
        procs.append(launch(0, "0", None))
        addr = folder / "peer0.addr"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (not addr.exists() or not addr.read_text().strip()) and not stop_requested.is_set():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the first peer did not start:\n" + (folder / "peer0.err").read_text()[-2000:])
            stop_requested.wait(0.1)
        bootstrap = addr.read_text().split()[0] if addr.exists() else ""
        if bootstrap_file is not None and bootstrap:
            bootstrap_file.write_text(bootstrap + "\n")
        for i in range(1, n):
            if stop_requested.is_set():
                break
            procs.append(launch(i, str(i // replicas), bootstrap))
        joiner_started = False
        with (
            Live(
                table(stage_rows(folder, n, replicas), stages, spec.train.steps), console=console, refresh_per_second=2
            )
            if not quiet
            else _NoLive()
        ) as live:
            while any(p.poll() is None for p in procs[:replicas]) and not stop_requested.is_set():
                rows = stage_rows(folder, len(procs), replicas)
                step0 = min((r["step"] for r in rows if r["stage"] == 0), default=0)
                if kill_at_step is not None and not killed and step0 >= kill_at_step and n > replicas:
                    victim = replicas  # the first replica of stage 1
                    os.killpg(procs[victim].pid, signal.SIGKILL)
                    killed.append(victim)
                    if not quiet:
                        console.print(f"killed peer {victim} (stage 1) at step {step0}")
                if join_auto_at_step is not None and not joiner_started and step0 >= join_auto_at_step:
                    # Through a survivor other than peer 0: p2pd on loopback refuses a dial to a peer that
                    # already holds many connections from this address ("failed to connect to bootstrap peers").
                    others = [folder / f"peer{i}.addr" for i in range(1, n) if i not in killed]
                    via = next(
                        (f.read_text().split()[0] for f in others if f.exists() and f.read_text().strip()), bootstrap
                    )
                    procs.append(launch(len(procs), "auto", via))
                    joiner_started = True
                live.update(table(rows, stages, spec.train.steps))
                stop_requested.wait(0.5)
            # Stage 0 is done: the servers stop by themselves once they see it; give them a moment.
            deadline = time.monotonic() + 30
            while (
                any(p.poll() is None for i, p in enumerate(procs) if i not in killed)
                and time.monotonic() < deadline
                and not stop_requested.is_set()
            ):
                stop_requested.wait(0.3)
            live.update(table(stage_rows(folder, len(procs), replicas), stages, spec.train.steps))
        interrupted = stop_requested.is_set()
    finally:
        _stop(procs, grace_s=15.0)
        for e in errs:
            e.close()
        for sig, h in old.items():
            signal.signal(sig, h)
    try:
        rows = stage_rows(folder, len(procs), replicas)
        finals = [r["finished"] for r in rows if r["finished"]]
        failed = [
            i for i, p in enumerate(procs) if p.returncode not in (0, None) and i not in killed and not interrupted
        ]
        for i in failed:
            console.print(
                f"[red]peer {i} exited with {procs[i].returncode}:[/]\n" + (folder / f"peer{i}.err").read_text()[-1500:]
            )
        drivers = [f for f in finals if f["stage"] == 0]
        wire = sum(f["bytes_fwd"] + f["bytes_tokens"] + f["bytes_bwd"] for f in finals)
        crossed = sum(f["tokens_forwarded"] for f in finals)
        stats = timeline_stats(finals, stages)
        trained = sum(f["steps"] for f in drivers) * spec.data.batch_size * spec.data.seq_len
        summary = {
            "stages": stages,
            "replicas": replicas,
            "peers": len(procs),
            "initial_loss": _mean([f["initial_loss"] for f in drivers]),
            "final_loss": _mean([f["final_loss"] for f in drivers]),
            "steps": min((f["steps"] for f in drivers), default=0),
            "microbatches_lost": sum(f["microbatches_lost"] for f in drivers),
            "microbatches_rerouted": sum(f["microbatches_rerouted"] for f in finals),
            "bytes_per_token_per_boundary": wire / crossed if crossed else float("nan"),
            "stage_of_peer": [r["stage"] for r in rows],
            "killed_peers": killed,
            "failed_peers": failed,
            "interrupted": interrupted,
            "joiner_stage": next((e.get("stage") for e in rows[-1]["events"] if e["event"] == "started"), None)
            if len(rows) > n
            else None,
            "joiner_synced": any(e["event"] == "synced" for e in rows[-1]["events"]) if len(rows) > n else None,
            "joiner_microbatches": (rows[-1]["finished"] or {}).get("microbatches") if len(rows) > n else None,
            "faults": sum(f["faults"] for f in finals),
            "replica_syncs": {
                str(st): {
                    k: sum(f.get(f"exchanges_{k}", 0) for f in finals if f["stage"] == st) for k in ("ok", "failed")
                }
                for st in range(stages)
            },
            "joiner_syncs": (
                {k: (rows[-1]["finished"] or {}).get(f"exchanges_{k}") for k in ("ok", "failed")}
                if len(rows) > n
                else None
            ),
            "wall_s": time.perf_counter() - t0,
            "tokens_trained": trained,
            "tokens_per_s": trained / stats["train_span_s"] if stats.get("train_span_s") else None,
            **stats,
        }
        if keep is not None:
            shutil.copytree(folder, keep, dirs_exist_ok=True)
        if not quiet:
            console.print(
                f"pipeline {stages}x{replicas}: loss {summary['initial_loss']:.3f} -> "
                f"{summary['final_loss']:.3f} in {summary['steps']} steps, "
                f"{summary['microbatches_lost']} lost, {summary['microbatches_rerouted']} re-routed, "
                f"{summary['bytes_per_token_per_boundary']:.1f} B/token/boundary"
            )
        return summary
    finally:
        shutil.rmtree(folder, ignore_errors=True)

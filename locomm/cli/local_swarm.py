"""`locomm-peer swarm [--pipeline SxR]`: real peer processes on loopback, a live table, a clean stop, a summary.

Each peer is a `locomm-peer join` process in its own process group (so its p2pd child goes with it),
writing JSON-lines events to a temporary folder that this launcher tails for the live table
(:mod:`locomm.cli.swarm_view` reads it). The first peer starts the swarm; the others join through its
multiaddr, all with the same run spec file (so each verifies the swarm's spec hash). Two modes share
the machinery (:class:`PeerGroup`):

- data-parallel (:func:`run_swarm`): N peers train ``rounds`` outer rounds on shards ``i/N``;
- pipeline (:func:`run_pipeline_swarm`): S stages x R replicas (``join --stage K``); stage-0 replicas
  train ``train.steps`` optimizer steps, the other stages serve until every stage-0 replica has finished.
  A stage-1 replica can be killed at a step and a ``--stage auto`` joiner started at another (resilience).

On Ctrl-C, SIGTERM or SIGHUP (the ssh session closing) every peer gets SIGINT (they finish the step,
checkpoint and shut P2P down), then anything left is killed; the temporary folder is removed either way.
No peer outlives the launcher even when it is SIGKILLed (:mod:`locomm.peer.lifeline`): each peer starts
behind a parent-death shim (SIGTERM when the launcher dies), and a reaper process, which owns the
temporary folder, stops whatever is left and removes the folder when the launcher's lifeline pipe closes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from locomm.checkpoint import atomic_write_bytes
from locomm.cli.swarm_view import (
    live_table,
    max_weight_distance,
    peer_rows,
    peer_table,
    pipeline_summary,
    read_events,
    stage_rows,
    stage_table,
    swarm_summary,
    timeline_stats,
    write_swarm_plot,
)
from locomm.config import RunSpec
from locomm.peer.lifeline import MARKER, Reaper, pdeath_argv
from locomm.peer.options import local_defaults

__all__ = [
    "STARTUP_TIMEOUT_S",
    "PeerGroup",
    "max_weight_distance",
    "peer_rows",
    "read_events",
    "run_pipeline_swarm",
    "run_swarm",
    "stage_rows",
    "table",
    "timeline_stats",
    "write_swarm_plot",
]

STARTUP_TIMEOUT_S = 90.0
table = peer_table  # the data-parallel table, under its earlier name


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGINT to every peer, ``grace_s`` to exit, then SIGKILL to whatever is left in each peer's group.

    The peer alone, not its group: its p2pd must live until the peer has shut P2P down (a p2pd killed
    under a peer mid-start-up or mid-exchange turned a clean stop into tracebacks and a hang)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # a peer that hung, its p2pd
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


REAPER_GRACE_S = 8.0
"""After the launcher dies, how long its peers get for a clean stop before the reaper SIGKILLs them."""


@contextlib.contextmanager
def _scratch(prefix: str) -> Iterator[tuple[Path, Reaper]]:
    """A temporary folder owned by a reaper process (removed when this launcher exits, however)."""
    with Reaper(prefix, grace_s=REAPER_GRACE_S) as reaper:
        try:
            yield reaper.folder, reaper
        finally:
            shutil.rmtree(reaper.folder, ignore_errors=True)


def _copy_atomic(src: str, dst: str) -> None:
    atomic_write_bytes(Path(dst), Path(src).read_bytes())


def _keep(folder: Path, keep: Path) -> None:
    """Copy the swarm's folder to ``keep``, each file atomically (a kill leaves whole files only)."""
    shutil.copytree(folder, keep, dirs_exist_ok=True, copy_function=_copy_atomic)


class PeerGroup:
    """The `locomm-peer join` processes of one local swarm, logging to ``folder``; a context manager that
    stops them all on exit (SIGINT, ``grace_s``, SIGKILL) and restores the signal handlers it installed.

    Ctrl-C (or SIGTERM) only sets :attr:`stop_requested`, which every wait checks: a KeyboardInterrupt
    raised at an arbitrary point could leave a peer started but not yet in :attr:`procs` (never stopped),
    or interrupt rich's Live while it holds its lock (its refresh thread then never ends and the launcher
    hangs). Handlers are installed from the main thread only (a test may run the launcher in a thread).

    ``spawn(i, argv, **popen_kw)`` starts peer ``i`` (default: a local process in its own session, behind
    the parent-death shim; the link bench starts each in its network namespace, where only ``reaper`` and
    the marker cover a SIGKILLed launcher). ``size`` peers share the machine's cores. ``reaper`` learns each
    peer's pid, to stop it if this launcher dies. ``stop``, when given, is the caller's own handle on
    :attr:`stop_requested` (a test that runs the launcher in a thread stops it as Ctrl-C would).
    """

    def __init__(
        self,
        folder: Path,
        spec: RunSpec,
        *,
        size: int,
        grace_s: float,
        spawn: Callable[..., subprocess.Popen] | None = None,
        reaper: Reaper | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.folder = folder
        self.reaper = reaper
        self.spec_path = folder / "run.toml"
        spec.save(self.spec_path)
        self.size = size
        self.grace_s = grace_s
        self.spawn = spawn
        self.procs: list[subprocess.Popen] = []
        self.stop_requested = stop if stop is not None else threading.Event()
        self._errs: list[Any] = []
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> PeerGroup:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if sig != signal.SIGTERM and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup, or a shell's background job: the user asked us to ignore it
                self._old_handlers[sig] = signal.signal(sig, lambda *_: self.stop_requested.set())
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _stop(self.procs, grace_s=self.grace_s)
            if self.reaper is not None:
                for p in self.procs:
                    if p.returncode is not None:
                        self.reaper.forget(p.pid)
        finally:
            for e in self._errs:
                e.close()
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)

    def dump_tasks(self, wait_s: float = 2.0) -> None:
        """SIGUSR1 to every running peer: each logs where its tasks wait (to its stderr file) before the stop."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGUSR1)
        time.sleep(wait_s)

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def wait(self, seconds: float) -> None:
        """Sleep, waking at once on Ctrl-C."""
        self.stop_requested.wait(seconds)

    def start(self, args: Sequence[str]) -> subprocess.Popen:
        """Start the next peer (index ``len(procs)``) with the shared spec, its log, and ``args``."""
        i = len(self.procs)
        cmd = [sys.executable, "-m", "locomm.cli.main", "join", "--config", str(self.spec_path)]
        cmd += ["--log-file", str(self.folder / f"peer{i}.jsonl"), *args]
        cmd += local_defaults(cmd)  # loopback unless told; --new-swarm for the first
        err = open(self.folder / f"peer{i}.err", "w")  # noqa: SIM115 - closed on exit
        self._errs.append(err)
        # Share the cores instead of every peer's torch grabbing all of them.
        threads = str(max(1, (os.cpu_count() or 1) // self.size))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, MARKER: str(self.folder)}
        # TMPDIR in the folder: what a SIGKILLed peer leaves there (its identity folder) goes with it. Not
        # when that path is long: torch's shm manager binds a socket under it (`torch-shm-dir-XXXXXX/
        # manager.sock`), and a socket path has at most 107 bytes.
        if len(str(self.folder)) <= 60:
            env["TMPDIR"] = str(self.folder)
        kw: dict[str, Any] = dict(stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=env)
        if self.spawn is not None:
            p = self.spawn(i, cmd, **kw)
        else:  # SIGTERM (a clean stop) if this launcher dies
            p = subprocess.Popen(pdeath_argv(cmd, signal.SIGTERM), start_new_session=True, **kw)
        self.procs.append(p)
        if self.reaper is not None:
            self.reaper.watch(p.pid)
        return p

    def address(self, i: int) -> str | None:
        """Peer ``i``'s first announced multiaddr, once it has written one."""
        f = self.folder / f"peer{i}.addr"
        text = f.read_text().strip() if f.exists() else ""
        return text.split()[0] if text else None

    def wait_for_first(self) -> str:
        """Peer 0's multiaddr once it is up ("" on Ctrl-C); raises if it exits or is not up in time."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (addr := self.address(0)) is None and not self.stopping:
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the first peer did not start:\n" + self.stderr(0, 2000))
            self.wait(0.1)
        return addr or ""

    def running(self, only: Sequence[int] | None = None) -> bool:
        """Whether any peer (of the indices ``only``, of those started) is still running."""
        procs = self.procs if only is None else [self.procs[i] for i in only if i < len(self.procs)]
        return any(p.poll() is None for p in procs)

    def stderr(self, i: int, tail: int) -> str:
        return (self.folder / f"peer{i}.err").read_text()[-tail:]

    def failed(self, console: Console, *, interrupted: bool, exclude: Sequence[int] = ()) -> list[int]:
        """Peers that exited with an error (none after Ctrl-C), each reported with its stderr's tail."""
        if interrupted:
            return []
        out = [i for i, p in enumerate(self.procs) if p.returncode not in (0, None) and i not in exclude]
        for i in out:
            console.print(f"[red]peer {i} exited with {self.procs[i].returncode}:[/]\n" + self.stderr(i, 1500))
        return out


def run_swarm(
    spec: RunSpec,
    *,
    peers: int,
    rounds: int,
    quiet: bool,
    plot: Path | None,
    keep: Path | None = None,
    peer_args: tuple[str, ...] = (),
    eval_every: int = 1,
    islands: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Run ``peers`` data-parallel peers for ``rounds`` outer rounds, each evaluating every ``eval_every``
    rounds (0: at the start and the end only); the summary of what they report. ``islands=(K, N)``: the first
    K*N peers form K islands of N (``join --island``)."""
    console = Console(stderr=True)
    t0 = time.perf_counter()
    with _scratch("locomm-swarm-") as (folder, reaper):
        group = PeerGroup(folder, spec, size=peers, grace_s=20.0, reaper=reaper)

        def args(i: int) -> list[str]:
            return [
                *("--until-round", str(rounds), "--final-weights", str(folder / f"peer{i}.safetensors")),
                *("--shard", f"{i}/{peers}", "--checkpoint-dir", str(folder / f"ckpt{i}")),
                *("--wait-for-peers", str(peers), "--eval-every", str(eval_every), *peer_args),
                *island_args(i),
            ]

        def island_args(i: int) -> list[str]:
            if islands is None or i >= islands[0] * islands[1]:
                return []
            return ["--island", f"island{i // islands[1]}", "--island-size", str(islands[1])]

        with group:
            group.start([*args(0), "--announce-file", str(folder / "peer0.addr")])
            bootstrap = group.wait_for_first()
            for i in range(1, peers):
                if group.stopping:
                    break
                group.start([*args(i), "--initial-peers", bootstrap])
            if not group.stopping:
                with live_table(peer_table(peer_rows(folder, peers), rounds), console, quiet) as live:
                    while group.running() and not group.stopping:
                        live.update(peer_table(peer_rows(folder, peers), rounds))
                        group.wait(0.5)
                    live.update(peer_table(peer_rows(folder, peers), rounds))
            interrupted = group.stopping
            if interrupted:
                console.print("stopping the swarm (Ctrl-C)...")
        rows = peer_rows(folder, peers)
        failed = group.failed(console, interrupted=interrupted)
        summary = swarm_summary(folder, rows, peers=peers, rounds=rounds)
        summary.update(wall_s=time.perf_counter() - t0, interrupted=interrupted, failed_peers=failed)
        if plot is not None:
            write_swarm_plot(plot, rows)  # atomically: a reader sees the old figure or the new one
            summary["plot"] = str(plot)
        if keep is not None:
            _keep(folder, keep)
    if not quiet:
        console.print()
        console.print(
            f"swarm: {summary['rounds_completed']}/{rounds} rounds, loss {summary['initial_loss']:.3f} -> "
            f"{summary['final_loss']:.3f}, {summary['bytes_sent'] / 1e6:.1f} MB sent, "
            f"max weight distance {summary['max_weight_distance']:.4f}" + (f", plot {plot}" if plot else "")
        )
    return summary


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
    eval_every: int = 1,
    plot: Path | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Run S x R peers to the end of ``spec.train.steps``; optionally kill one stage-1 replica at a step
    and start a ``--stage auto`` joiner at another (resilience). ``bootstrap_file`` receives the first
    peer's multiaddr once it is up (for a test or a `status` call beside the run).

    ``spawn(i, argv, **popen_kw)`` starts peer ``i`` (default: a local process in its own session; the
    link bench starts each in its network namespace) and ``host_maddr(i)`` is its ``--host-maddrs``
    (default: loopback, any port). Each peer gets ``--eval-every eval_every``; ``plot`` receives the
    run's figure (stage 0's loss: :mod:`locomm.cli.plot`). ``stop`` set ends the run as Ctrl-C does (its
    summary then says ``interrupted``; ``keep`` still receives the logs)."""
    console = Console(stderr=True)
    spec = spec.replace("pipeline", stages=stages)
    n = stages * replicas
    t0 = time.perf_counter()
    killed: list[int] = []
    steps = spec.train.steps
    with _scratch("locomm-pipe-") as (folder, reaper):
        group = PeerGroup(folder, spec, size=n, grace_s=15.0, spawn=spawn, reaper=reaper, stop=stop)

        def start(stage: str, initial: str | None) -> None:
            i = len(group.procs)
            args = ["--stage", stage, "--shard", f"{i % replicas}/{replicas}", "--wait-for-peers", str(n), "-q"]
            args += ["--eval-every", str(eval_every)]
            args += [*peer_args, *(["--host-maddrs", host_maddr(i)] if host_maddr is not None else [])]
            args += ["--announce-file", str(folder / f"peer{i}.addr")] + (
                ["--initial-peers", initial] if initial else []
            )
            group.start(args)

        with group:
            start("0", None)
            bootstrap = group.wait_for_first()
            if bootstrap_file is not None and bootstrap:
                atomic_write_bytes(bootstrap_file, (bootstrap + "\n").encode())
            for i in range(1, n):
                if group.stopping:
                    break
                start(str(i // replicas), bootstrap)
            joiner_started = False
            with live_table(stage_table(stage_rows(folder, n, replicas), stages, steps), console, quiet) as live:
                while group.running(range(replicas)) and not group.stopping:
                    rows = stage_rows(folder, len(group.procs), replicas)
                    step0 = min((r["step"] for r in rows if r["stage"] == 0), default=0)
                    if kill_at_step is not None and not killed and step0 >= kill_at_step and n > replicas:
                        victim = replicas  # the first replica of stage 1
                        os.killpg(group.procs[victim].pid, signal.SIGKILL)
                        killed.append(victim)
                        if not quiet:
                            console.print(f"killed peer {victim} (stage 1) at step {step0}")
                    if join_auto_at_step is not None and not joiner_started and step0 >= join_auto_at_step:
                        # Through a survivor other than peer 0: p2pd on loopback refuses a dial to a peer that
                        # already holds many connections from this address ("failed to connect to bootstrap peers").
                        others = (group.address(i) for i in range(1, n) if i not in killed)
                        start("auto", next((a for a in others if a), bootstrap))
                        joiner_started = True
                    live.update(stage_table(rows, stages, steps))
                    group.wait(0.5)
                # Stage 0 is done: the servers stop by themselves once they see it; give them a moment.
                deadline = time.monotonic() + 30
                alive = [i for i in range(len(group.procs)) if i not in killed]
                while group.running(alive) and time.monotonic() < deadline and not group.stopping:
                    group.wait(0.3)
                live.update(stage_table(stage_rows(folder, len(group.procs), replicas), stages, steps))
            interrupted = group.stopping
            if stop is not None and stop.is_set():  # the caller gave up on the run: each live peer logs its tasks
                group.dump_tasks()
        rows = stage_rows(folder, len(group.procs), replicas)
        failed = group.failed(console, interrupted=interrupted, exclude=killed)
        summary = pipeline_summary(rows, spec, stages=stages, replicas=replicas)
        summary.update(
            killed_peers=killed, failed_peers=failed, interrupted=interrupted, wall_s=time.perf_counter() - t0
        )
        if plot is not None:
            write_swarm_plot(plot, rows)
            summary["plot"] = str(plot)
        if keep is not None:
            _keep(folder, keep)
    if not quiet:
        console.print(
            f"pipeline {stages}x{replicas}: loss {summary['initial_loss']:.3f} -> "
            f"{summary['final_loss']:.3f} in {summary['steps']} steps, "
            f"{summary['microbatches_lost']} lost, {summary['microbatches_rerouted']} re-routed, "
            f"{summary['bytes_per_token_per_boundary']:.1f} B/token/boundary"
        )
    return summary

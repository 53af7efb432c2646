"""Chaos bench: real `locomm-peer join` peers in shaped network namespaces, under seeded random faults.

N peers (each in its own netlab namespace, one shaped veth pair each: locomm/testing/netlab.py), started with
locomm/testing/launcher.py, train for ``--minutes`` while faults drawn from ``random.Random(--seed)`` hit them:

- ``kill_restart``: SIGKILL of the peer process alone (its p2pd must die by its parent-death signal; we look
  8 s later; a peer still starting or syncing may be the target too, ``kill_starting``, while the live
  count is at the floor or above), then a restart from its
  ``--checkpoint-dir`` (``--checkpoint-every 1``) with the same ``--identity`` after a random delay;
- ``corrupt_restart``: the same, with the checkpoint file truncated or overwritten with garbage before the
  restart (the peer must set it aside, a ``checkpoint_set_aside`` event, and sync from the swarm);
- ``stop_cont``: SIGSTOP to the peer's process group (the peer and its p2pd: a machine that froze), SIGCONT
  after a random 1-8 s, or 15-30 s (past the heartbeat TTL of benchmarks/configs/chaos-nano.toml, 12 s);
- ``slow_link``: the host's link slowed with tc tbf (``host.shape``) to 0.5-5 Mbit/s, restored 5-30 s later;
- ``late_join``: a fresh peer (new host or a freed one, new identity, no checkpoint) joins WITHOUT --config
  through a random live peer; every process runs with LOCOMM_SPEC_TTL_S=20, so after the first 20 s every
  join comes after the first spec record's TTL (and often after the peer that published it left);
- ``leave_exchanging``: SIGINT or SIGTERM (to the peer alone or its group) just after one of its "round"
  events, while that round's exchange is in flight; ``leave_random``: the same at a random time. A clean
  leave publishes a final 'finished' heartbeat (locomm/peer/presence.py). Some seconds later the same
  peer (its identity and checkpoint, with --config) or a fresh one (without) joins again;
- ``link_drop``: just after one of the peer's "round" events (its exchange in flight) its link drops to
  1 Mbit/s for 10-40 s, then comes back;
- ``disk_full``: the peer's checkpoint folder sits on a tmpfs of ``--disk-mb`` per machine (0: the ordinary
  disk, and no such fault); the fault fills that tmpfs to the last byte for 20-90 s (several checkpoint
  writes, ``--checkpoint-every 1``), then frees it: the peer must log ENOSPC and train on;
- ``clock_step``: the machine's wall clock (CLOCK_REALTIME of its peer process, through the LD_PRELOAD shim
  of locomm/testing/wallclock.py, compiled at the start; monotonic clocks are untouched, as in an NTP step) steps
  by +30 or -30 s for 20-120 s, then steps back. Without a C compiler this kind is not drawn (reported).

The live count (peers up and not stopped) stays in ``--floor`` .. ``--ceiling``: a fault that would take it
below the floor is not drawn, a join that would pass the ceiling neither; when crashes take it below the
floor a fresh peer is started (``refill``). Faults come at exponential intervals of mean ``--fault-every``
seconds; kinds overlap (a stop can outlast the next kill).

    sudo .venv/bin/python benchmarks/chaos.py --minutes 3 --seed 0 --keep /tmp/chaos-dev   # a dev run
    sudo .venv/bin/python benchmarks/chaos.py --minutes 32 --seed 1 --out benchmarks/results/chaos.json --keep /tmp/logs
    sudo .venv/bin/python benchmarks/chaos.py --reanalyse old.json --keep /tmp/logs --out new.json  # analysis again

What the report counts (docs/results/chaos.md defines each one):

- faults by kind; every fault with its time, target and outcome;
- crashes: an incarnation (one process) that exited while we had not signalled it, or exited nonzero after a
  polite leave, or has a Traceback in its stderr (all of those are listed, faulted or not);
- exchange outcomes per (receiver, round, partner) from the "round" and "screened" events, each miss
  classified: the receiver was faulted around that round (its own loss), the partner was (collateral), or
  neither (unexplained); a round is lost when no planned partner's payload arrived;
- stalls: the gap between consecutive "round" events of an incarnation against its expected round time
  (that incarnation's median gap) and its deadline (expected + stall_timeout_s + expected / 4, the partner
  ETA's slack in locomm/protocol/timing.py); hangs (no round for ``HANG_S`` while up and not stopped);
- orphans: after the lab closed, any process whose environment carries this run's marker
  (LOCOMM_CHAOS_RUN) or whose command line names its folder; p2pd processes alive 8 s after their peer was
  SIGKILLed; leftover namespaces and files in the peers' TMPDIR;
- ``exchanges_ok``/``exchanges_failed``/``gave_up``/``gone_skipped`` summed over the "finished" summaries.

The JSON (``--out``) is rewritten every 60 s with what is known so far, and at the end, also on Ctrl-C or
SIGTERM (the lab stops the peers and deletes its namespaces first). Needs root (netlab).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from locomm.config import RunSpec
from locomm.testing import netlab, procs, wallclock
from locomm.testing.launcher import Launcher, PeerProcess

import _harness

REPO = _harness.REPO
DEFAULT_CONFIG = REPO / "benchmarks" / "configs" / "chaos-nano.toml"
KINDS = (
    "kill_restart",
    "kill_starting",
    "corrupt_restart",
    "stop_cont",
    "slow_link",
    "late_join",
    "leave_exchanging",
    "leave_random",
    "link_drop",
    "disk_full",
    "clock_step",
)
WEIGHTS = {
    "kill_restart": 0.20,
    "kill_starting": 0.04,
    "corrupt_restart": 0.07,
    "stop_cont": 0.20,
    "slow_link": 0.18,
    "late_join": 0.13,
    "leave_exchanging": 0.12,
    "leave_random": 0.10,
    "link_drop": 0.10,
    "disk_full": 0.07,
    "clock_step": 0.07,
}
KEPT_EVENTS = {
    "started",
    "round",
    "screened",
    "exchange",
    "left",
    "finished",
    "synced",
    "sync_failed",
    "checkpoint_set_aside",
    "spec_published",
    "eval",
}
SPEC_TTL_S = 20.0
ORPHAN_CHECK_S = 8.0
"""How long after a SIGKILL of a peer process its p2pd (same process group) may live."""
HANG_S = 180.0
"""An incarnation up and not stopped with no "round" event for this long is recorded as hung."""
LEAVE_HANG_S = 90.0
"""A peer asked to leave that has not exited after this long is recorded and killed."""
ARM_TIMEOUT_S = 30.0
"""A mid-exchange leave waits this long for the next round event, then signals anyway."""
IMPAIR_SLACK_S = 3.0
"""A fault counts for a round when its interval comes within this many seconds of the round's exchange."""
CLOCK_TRUST_S = 20.0
"""An event whose ``time`` (the peer's clock) is further than this from ours when we read it is placed at our read
time (its own stamp kept as ``peer_time``): the clock-step fault moves a peer's clock +-30 s, and the analysis
would otherwise place its rounds 30 s off (seed 11 counted a gap of -11.8 s). We read every poll, so the error is
one poll's lag. Logs re-read with ``--reanalyse`` hold only the peers' stamps."""
MARKER = "LOCOMM_CHAOS_RUN"


# ------------------------------------------------------------------------------------ bookkeeping


class LogTail:
    """Incremental reader of one JSON-lines log: the complete lines added since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.buf = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                if isinstance(e, dict) and e.get("event") in KEPT_EVENTS:
                    out.append(e)
        return out


@dataclass
class Machine:
    """One namespace host; it runs at most one peer at a time. ``gen`` counts the identities it has had."""

    index: int
    host: netlab.Host
    rate: str
    gen: int = 0
    shaped: bool = False
    disk: Path | None = None
    """The tmpfs holding this machine's checkpoint folders (``--disk-mb``), or None."""
    clock: wallclock.Clock | None = None
    """The wall clock of its peers (locomm/testing/wallclock.py), or None without the shim."""
    disk_full: bool = False
    clock_stepped: bool = False
    reserved: bool = False
    """A restart or rejoin is scheduled here."""
    inc: Inc | None = None


@dataclass
class Inc:
    """One incarnation: one `join` process."""

    name: str
    machine: Machine
    gen: int
    peer: PeerProcess
    how: str
    """initial, restart, rejoin, late_join, refill."""
    with_config: bool
    t_start: float
    tail: LogTail
    events: list[dict[str, Any]] = field(default_factory=list)
    peer_id: str | None = None
    t_up: float | None = None
    rounds_seen: int = 0
    last_round_t: float | None = None
    stopped: bool = False
    cause: str | None = None
    """What ended it on our side: sigkill, sigint, sigterm, final; None: nothing (yet)."""
    t_signal: float | None = None
    t_exit: float | None = None
    returncode: int | None = None
    armed: dict[str, Any] | None = None
    drop_armed: float | None = None
    """link_drop: when it was drawn; the link drops at the next "round" event (or ARM_TIMEOUT_S later)."""
    hang_reported: bool = False

    @property
    def alive(self) -> bool:
        return self.t_exit is None

    @property
    def up(self) -> bool:
        return self.alive and self.t_up is not None and self.cause is None

    @property
    def key(self) -> str:
        return f"m{self.machine.index}g{self.gen}"


class Chaos:
    """The run: machines, incarnations, the fault schedule and the records."""

    def __init__(self, args: argparse.Namespace, lab: netlab.Lab, folder: Path, spec_path: Path) -> None:
        self.args, self.lab, self.folder, self.spec_path = args, lab, folder, spec_path
        self.rng = random.Random(args.seed)
        self.t0 = time.time()
        self.tmpdir = folder / "tmp"
        self.tmpdir.mkdir()
        self.tag = f"{lab.run_name}-{os.getpid()}"
        threads = "1"
        env = {
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1",
            "LOCOMM_SPEC_TTL_S": str(args.spec_ttl),
            "TMPDIR": str(self.tmpdir),
            MARKER: self.tag,
        }
        self.launcher = Launcher(folder, grace_s=args.grace, stop_signal=signal.SIGINT, threads=1, env=env, cwd=REPO)
        self.machines: list[Machine] = []
        self.incs: list[Inc] = []
        self.faults: list[dict[str, Any]] = []
        self.joins: list[dict[str, Any]] = []
        self.findings: list[dict[str, Any]] = []
        self.orphans_after_kill: list[dict[str, Any]] = []
        self.timeline: list[tuple[Any, ...]] = []  # (t, live, alive, load 1 min, MB available) samples
        self.heap: list[tuple[float, int, str, Callable[[], None]]] = []
        self.seq = 0
        self.next_fault = 0.0
        self.chaos_end: float | None = None
        self.infeasible = 0
        self.weights = dict(WEIGHTS)
        for item in args.weights or []:
            k, _, w = item.partition("=")
            if k not in WEIGHTS:
                raise SystemExit(f"--weights: unknown kind {k!r} (one of {', '.join(KINDS)})")
            self.weights[k] = float(w)
        self.sockets: dict[str, str] = {}
        """p2pd socket uid -> incarnation, from the p2pd command lines seen."""
        self.last_scan = 0.0
        self.mounts: list[Path] = []
        self.skipped: dict[str, str] = {}
        """Fault kinds this machine cannot inject, with why (their weight is set to 0)."""
        self.clock_shim, why = wallclock.build(folder)
        if self.clock_shim is None:
            self.skip("clock_step", why)
        if args.disk_mb <= 0:
            self.skip("disk_full", "--disk-mb 0: the checkpoint folders are on the ordinary disk")

    def skip(self, kind: str, why: str) -> None:
        self.weights[kind] = 0.0
        self.skipped[kind] = why
        self.log(f"{kind} is not drawn: {why}")

    # -- helpers ----------------------------------------------------------------------------

    def now(self) -> float:
        return time.time() - self.t0

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[{self.now():7.1f}s] {msg}", file=sys.stderr, flush=True)

    def later(self, delay: float, what: str, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.now() + delay, self.seq, what, fn))

    def live(self) -> list[Inc]:
        """Up and not stopped (and not asked to leave): the peers the floor counts."""
        return [i for i in self.incs if i.up and not i.stopped and i.armed is None]

    def alive(self) -> list[Inc]:
        return [i for i in self.incs if i.alive]

    def occupied(self) -> int:
        """Peers running or starting, plus scheduled restarts and rejoins: what the ceiling counts."""
        return sum(1 for m in self.machines if (m.inc is not None and m.inc.alive) or m.reserved)

    def free_machines(self) -> list[Machine]:
        return [m for m in self.machines if not m.reserved and (m.inc is None or not m.inc.alive)]

    def fault(self, kind: str, inc: Inc | None, **info: Any) -> dict[str, Any]:
        rec = {"id": len(self.faults), "kind": kind, "t": round(self.now(), 3)}
        if inc is not None:
            rec |= {"inc": inc.name, "key": inc.key, "peer_id": inc.peer_id, "machine": inc.machine.index}
        rec |= info
        self.faults.append(rec)
        self.log(f"fault #{rec['id']} {kind} {inc.name if inc else ''} {info or ''}")
        return rec

    def finding(self, kind: str, inc: Inc | None, **info: Any) -> None:
        rec = {"kind": kind, "t": round(self.now(), 3)}
        if inc is not None:
            rec |= {"inc": inc.name, "key": inc.key, "peer_id": inc.peer_id, "stderr_tail": inc.peer.tail(1500)}
        rec |= info
        self.findings.append(rec)
        self.log(f"FINDING {kind} {inc.name if inc else ''} {info}")

    # -- starting peers -----------------------------------------------------------------------

    def build(self) -> None:
        for i in range(self.args.machines):
            rate = self.args.rate
            m = Machine(i, self.lab.add_host(f"m{i}", rate=None if rate == "none" else rate), rate)
            if self.args.disk_mb > 0:
                m.disk = self.folder / "disk" / f"m{i}"
                m.disk.mkdir(parents=True)
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_mb}m,mode=0700", "tmpfs", str(m.disk)],
                    check=True,
                )
                self.mounts.append(m.disk)
            if self.clock_shim is not None:
                (self.folder / "clock").mkdir(exist_ok=True)
                m.clock = wallclock.Clock(self.clock_shim, self.folder / "clock" / f"m{i}")
            self.machines.append(m)

    def ckpt_dir(self, m: Machine, gen: int) -> Path:
        return (m.disk if m.disk is not None else self.folder / "ckpt") / f"m{m.index}g{gen}"

    def bootstrap_addr(self, exclude: Machine | None = None) -> str | None:
        cands = [i for i in self.live() if i.machine is not exclude]
        if not cands:
            return None
        inc = self.rng.choice(cands)
        try:
            return inc.peer.address(timeout=1.0, ip=inc.machine.host.ip)
        except Exception:  # noqa: BLE001 - its announce file is gone or it exited: try another next time
            return None

    def start(
        self, m: Machine, how: str, *, fresh: bool, with_config: bool, first: bool = False, extra: tuple[str, ...] = ()
    ) -> Inc | None:
        """Start a peer on ``m`` (``fresh``: a new identity and an empty checkpoint folder)."""
        initial = None
        if not first:
            initial = self.bootstrap_addr(exclude=m)
            if initial is None:
                return None
        if fresh:
            m.gen += 1
        name = f"m{m.index}g{m.gen}i{sum(1 for i in self.incs if i.machine is m and i.gen == m.gen)}"
        ckpt = self.ckpt_dir(m, m.gen)
        ckpt.mkdir(parents=True, exist_ok=True)
        env = m.clock.env() if m.clock is not None else {}
        ident = self.folder / "ids" / f"m{m.index}g{m.gen}.key"
        ident.parent.mkdir(exist_ok=True)
        peer = self.launcher.start(
            name,
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "1",
            "--identity",
            str(ident),
            "--host-maddrs",
            f"/ip4/{m.host.ip}/tcp/0",
            "-q",
            *extra,
            config=self.spec_path if with_config else None,
            initial_peers=initial,
            spawn=m.host.popen,
            env=env,
        )
        inc = Inc(name, m, m.gen, peer, how, with_config, self.now(), LogTail(peer.log))
        self.incs.append(inc)
        m.inc, m.reserved = inc, False
        self.joins.append(
            {
                "inc": name,
                "key": inc.key,
                "how": how,
                "t": round(inc.t_start, 3),
                "with_config": with_config,
                "after_spec_ttl": inc.t_start > self.args.spec_ttl,
                "via": initial,
            }
        )
        self.log(f"start {name} ({how}{', no --config' if not with_config else ''})")
        return inc

    def start_or_retry(self, m: Machine, how: str, *, fresh: bool, with_config: bool, tries: int = 20) -> None:
        if self.chaos_end is not None:
            m.reserved = False
            return
        if self.start(m, how, fresh=fresh, with_config=with_config) is None:
            if tries <= 0:
                m.reserved = False
                self.finding("start_gave_up", None, machine=m.index, how=how)
                return
            self.later(
                2.0,
                f"retry {how}",
                lambda: self.start_or_retry(m, how, fresh=fresh, with_config=with_config, tries=tries - 1),
            )

    # -- polling ------------------------------------------------------------------------------

    def poll(self) -> None:
        t = self.now()
        for inc in self.incs:
            if inc.t_exit is not None:
                continue
            for e in self.read(inc):
                inc.events.append(e)
                ev = e.get("event")
                if ev == "started":
                    inc.peer_id, inc.t_up = e.get("peer"), t
                    inc.last_round_t = t
                elif ev == "round":
                    inc.rounds_seen += 1
                    inc.last_round_t = t
                    if inc.armed is not None and inc.cause is None:
                        self.leave_now(inc, **inc.armed)
                    if inc.drop_armed is not None:
                        self.drop_link(inc, e)
            if inc.drop_armed is not None and t - inc.drop_armed > ARM_TIMEOUT_S:
                self.drop_link(inc, None)
            if inc.armed is not None and inc.cause is None and t - inc.armed["armed_at"] > ARM_TIMEOUT_S:
                self.leave_now(inc, **{**inc.armed, "arm_timeout": True})
            rc = inc.peer.poll()
            if rc is not None:
                self.exited(inc, rc)
                continue
            if inc.cause in ("sigint", "sigterm") and t - (inc.t_signal or t) > LEAVE_HANG_S:
                self.finding("leave_hang", inc, after_s=round(t - inc.t_signal, 1))
                inc.peer.kill(group=True)
                inc.cause = "sigkill_after_leave_hang"
            if (
                inc.up
                and not inc.stopped
                and not inc.hang_reported
                and inc.last_round_t is not None
                and t - inc.last_round_t > HANG_S
            ):
                inc.hang_reported = True
                self.finding("no_round_for", inc, seconds=round(t - inc.last_round_t, 1), rounds=inc.rounds_seen)

    def read(self, inc: Inc) -> list[dict[str, Any]]:
        """The events ``inc`` wrote since the last read, each on our clock where its own is off (CLOCK_TRUST_S)."""
        seen = time.time()
        events = inc.tail.read()
        for e in events:
            t = e.get("time")
            if isinstance(t, (int, float)) and abs(t - seen) > CLOCK_TRUST_S:
                e["peer_time"], e["time"] = t, seen
        return events

    def exited(self, inc: Inc, rc: int) -> None:
        inc.events.extend(self.read(inc))
        inc.t_exit, inc.returncode = self.now(), rc
        m = inc.machine
        self.log(f"exit {inc.name} rc={rc} cause={inc.cause}")
        if inc.cause is None:
            self.finding("unexpected_exit", inc, returncode=rc)
        elif inc.cause in ("sigint", "sigterm") and rc != 0:
            self.finding("leave_exit_nonzero", inc, returncode=rc, signal=inc.cause)
        if inc.cause is None and self.chaos_end is None:
            m.reserved = False  # a crash frees the machine; refill() keeps the floor

    def refill(self) -> None:
        """Crashes (or a run of faults) took the swarm below the floor: start fresh peers."""
        if self.chaos_end is not None:
            return
        starting = [i for i in self.incs if i.alive and i.t_up is None]
        pending = sum(1 for m in self.machines if m.reserved)
        stopped = [i for i in self.incs if i.up and i.stopped]
        if len(self.live()) + len(starting) + pending + len(stopped) >= self.args.floor:
            return
        free = self.free_machines()
        if free and self.occupied() < self.args.ceiling:
            m = self.rng.choice(free)
            if self.start(m, "refill", fresh=True, with_config=self.rng.random() < 0.5) is None:
                self.log("refill: no live peer to join through")

    # -- faults -------------------------------------------------------------------------------

    def can_remove(self) -> list[Inc]:
        live = self.live()
        return live if len(live) - 1 >= self.args.floor else []

    def draw(self) -> bool:
        feasible: dict[str, list[Any]] = {}
        removable = self.can_remove()
        if removable:
            for k in ("kill_restart", "corrupt_restart", "stop_cont", "leave_exchanging", "leave_random"):
                feasible[k] = removable
        # a peer still starting (building, syncing) for 3 s is not counted by the floor: it may die too, while the
        # swarm is at its floor or above (below it, the starting peers are what restores the floor: killing them
        # then kept a 5.7M-parameter swarm, whose peers take 20-40 s to start on 2 cores, below its floor for
        # most of a run, with kill_starting 30% of the faults drawn against a weight of 1-4%)
        starting = [
            i for i in self.incs if i.alive and i.t_up is None and i.cause is None and self.now() - i.t_start > 3
        ]
        if starting and len(self.live()) >= self.args.floor:
            feasible["kill_starting"] = starting
        shapeable = [i for i in self.live() if not i.machine.shaped and i.drop_armed is None]
        if shapeable:
            feasible["slow_link"] = shapeable
            feasible["link_drop"] = shapeable
        fillable = [i for i in self.live() if i.machine.disk is not None and not i.machine.disk_full]
        if fillable:
            feasible["disk_full"] = fillable
        steppable = [i for i in self.live() if i.machine.clock is not None and not i.machine.clock_stepped]
        if steppable:
            feasible["clock_step"] = steppable
        if self.free_machines() and self.occupied() < self.args.ceiling and self.live():
            feasible["late_join"] = self.free_machines()
        if not feasible:
            return False
        kinds = [k for k in feasible if self.weights[k] > 0]
        if not kinds:
            return False
        kind = self.rng.choices(kinds, weights=[self.weights[k] for k in kinds])[0]
        target = self.rng.choice(feasible[kind])
        getattr(self, f"do_{kind}")(target)
        return True

    def do_kill_starting(self, inc: Inc) -> None:
        self.do_kill_restart(inc, kind="kill_starting")

    def do_kill_restart(self, inc: Inc, corrupt: bool = False, kind: str = "kill_restart") -> None:
        delay = self.rng.uniform(1.0, 25.0)
        mode = self.rng.choice(["truncate", "garbage"]) if corrupt else None
        rec = self.fault("corrupt_restart" if corrupt else kind, inc, restart_after_s=round(delay, 2), corrupt=mode)
        group = self.group_pids(inc.peer.pid)
        inc.cause, inc.t_signal = "sigkill", self.now()
        inc.peer.kill(group=False)  # the peer alone: its p2pd must follow by its parent-death signal
        m = inc.machine
        m.reserved = True
        self.later(ORPHAN_CHECK_S, "orphan check", lambda: self.check_orphans(inc, group, rec))
        self.later(delay, "restart", lambda: self.restart(m, inc, rec))

    def do_corrupt_restart(self, inc: Inc) -> None:
        self.do_kill_restart(inc, corrupt=True)

    def restart(self, m: Machine, dead: Inc, rec: dict[str, Any]) -> None:
        if rec.get("corrupt"):
            rec["corrupted"] = self.corrupt(m, rec["corrupt"])
        self.start_or_retry(m, "restart", fresh=False, with_config=dead.with_config)
        if m.inc is not None and m.inc is not dead:
            rec["restarted_as"] = m.inc.name

    def corrupt(self, m: Machine, mode: str) -> str | None:
        path = self.ckpt_dir(m, m.gen) / "checkpoint.safetensors"
        if not path.exists():
            return None
        size = path.stat().st_size
        if mode == "truncate":
            with open(path, "r+b") as f:
                f.truncate(max(1, size // 2))
        else:
            with open(path, "r+b") as f:
                f.seek(0)
                f.write(self.rng.randbytes(min(size, 4096)))
        return f"{mode} of {size} bytes"

    def do_stop_cont(self, inc: Inc) -> None:
        long = self.rng.random() < 0.3
        dur = self.rng.uniform(15.0, 30.0) if long else self.rng.uniform(1.0, 8.0)
        rec = self.fault("stop_cont", inc, stop_s=round(dur, 2), past_heartbeat_ttl=long)
        inc.peer.send_signal(signal.SIGSTOP, group=True)
        inc.stopped = True

        def cont() -> None:
            inc.peer.send_signal(signal.SIGCONT, group=True)
            inc.stopped = False
            inc.last_round_t = max(inc.last_round_t or 0.0, self.now() - 0.0)
            rec["t_end"] = round(self.now(), 3)

        self.later(dur, "SIGCONT", cont)

    def do_slow_link(self, inc: Inc) -> None:
        m = inc.machine
        rate = self.rng.choice(["500kbit", "1mbit", "2mbit", "5mbit"])
        dur = self.rng.uniform(5.0, 30.0)
        rec = self.fault("slow_link", inc, rate=rate, for_s=round(dur, 2))
        m.host.shape(up=rate, down=rate)
        m.shaped = True
        self.restore_link_later(m, dur, rec)

    def restore_link_later(self, m: Machine, dur: float, rec: dict[str, Any]) -> None:
        """The machine's own rate back in ``dur`` s (the fault record gets its end)."""

        def restore() -> None:
            base = None if m.rate == "none" else m.rate
            with contextlib.suppress(Exception):
                m.host.shape(up=base, down=base)
            m.shaped = False
            rec["t_end"] = round(self.now(), 3)

        self.later(dur, "restore link", restore)

    def do_link_drop(self, inc: Inc) -> None:
        inc.drop_armed = self.now()
        inc.machine.shaped = True  # reserved: no slow_link on it meanwhile

    def drop_link(self, inc: Inc, round_event: dict[str, Any] | None) -> None:
        """The armed link drop: 1 Mbit/s while the round's exchange is in flight, for 10-40 s."""
        m, armed_at, inc.drop_armed = inc.machine, inc.drop_armed or self.now(), None
        dur = self.rng.uniform(10.0, 40.0)
        since = round(time.time() - round_event["time"], 3) if round_event else None
        rec = self.fault(
            "link_drop",
            inc,
            rate="1mbit",
            for_s=round(dur, 2),
            armed_s=round(self.now() - armed_at, 3),
            after_round=round_event.get("round") if round_event else None,
            since_round_event_s=since,
        )
        with contextlib.suppress(Exception):
            m.host.shape(up="1mbit", down="1mbit")
        self.restore_link_later(m, dur, rec)

    def do_disk_full(self, inc: Inc) -> None:
        m = inc.machine
        assert m.disk is not None
        dur = self.rng.uniform(20.0, 90.0)
        filler = m.disk / "filler"
        st = os.statvfs(m.disk)
        free = st.f_bavail * st.f_frsize
        with open(filler, "wb") as f:
            with contextlib.suppress(OSError):  # ENOSPC at the last pages is the point
                os.posix_fallocate(f.fileno(), 0, max(free, 1))
            with contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))
        st = os.statvfs(m.disk)
        m.disk_full = True
        rec = self.fault("disk_full", inc, for_s=round(dur, 2), filled_mb=round(free / 2**20, 1))
        rec["free_after_fill_kb"] = st.f_bavail * st.f_frsize // 1024

        def free_it() -> None:
            with contextlib.suppress(OSError):
                filler.unlink()
            m.disk_full = False
            rec["t_end"] = round(self.now(), 3)

        self.later(dur, "free disk", free_it)

    def do_clock_step(self, inc: Inc) -> None:
        m = inc.machine
        assert m.clock is not None
        step = self.rng.choice([30.0, -30.0])
        dur = self.rng.uniform(20.0, 120.0)
        m.clock.step(step)
        m.clock_stepped = True
        rec = self.fault("clock_step", inc, step_s=step, for_s=round(dur, 2))

        def back() -> None:
            m.clock.step(0.0)
            m.clock_stepped = False
            rec["t_end"] = round(self.now(), 3)

        self.later(dur, "clock back", back)

    def do_late_join(self, m: Machine) -> None:
        inc = self.start(m, "late_join", fresh=True, with_config=False)
        if inc is None:
            self.log("late_join: no live peer to join through")
            return
        self.fault("late_join", inc, after_spec_ttl=inc.t_start > self.args.spec_ttl)

    def do_leave_exchanging(self, inc: Inc) -> None:
        sig = self.rng.choice([signal.SIGINT, signal.SIGTERM])
        group = self.rng.random() < 0.5
        inc.armed = {"sig": int(sig), "group": group, "armed_at": self.now(), "kind": "leave_exchanging"}

    def do_leave_random(self, inc: Inc) -> None:
        sig = self.rng.choice([signal.SIGINT, signal.SIGTERM])
        self.leave_now(inc, sig=int(sig), group=self.rng.random() < 0.5, armed_at=self.now(), kind="leave_random")

    def leave_now(
        self, inc: Inc, *, sig: int, group: bool, armed_at: float, kind: str, arm_timeout: bool = False
    ) -> None:
        inc.armed = None
        name = signal.Signals(sig).name
        rounds = [e for e in inc.events if e.get("event") == "round"]
        rec = self.fault(
            kind,
            inc,
            signal=name,
            group=group,
            armed_s=round(self.now() - armed_at, 3),
            arm_timeout=arm_timeout,
            after_round=rounds[-1].get("round") if rounds else None,
            since_round_event_s=round(time.time() - rounds[-1]["time"], 3) if rounds else None,
        )
        inc.cause, inc.t_signal = name.lower(), self.now()
        inc.peer.send_signal(sig, group=group)
        m = inc.machine
        m.reserved = True
        same = self.rng.random() < 0.5
        delay = self.rng.uniform(5.0, 40.0)
        rec["rejoin"] = {"same_identity": same, "after_s": round(delay, 2)}

        def rejoin() -> None:
            if inc.alive:  # still leaving: wait for it
                self.later(2.0, "rejoin (waiting for the leave)", rejoin)
                return
            if same:
                self.start_or_retry(m, "rejoin", fresh=False, with_config=True)
            else:
                self.start_or_retry(m, "rejoin", fresh=True, with_config=False)

        self.later(delay, "rejoin", rejoin)

    # -- orphans ------------------------------------------------------------------------------

    def group_pids(self, pgid: int) -> dict[int, str]:
        out = {pid: procs.cmdline(pid)[:600] for pid, p in procs.table().items() if p.pgid == pgid}
        self.note_sockets(out.values(), pgid)
        return out

    def note_sockets(self, cmdlines: Any, pgid: int) -> None:
        """Remember the p2pd socket names of our peers (hivemind puts them in /tmp whatever TMPDIR says)."""
        name = next((i.name for i in self.incs if i.peer.pid == pgid), str(pgid))
        for cmd in cmdlines:
            for arg in cmd.split():
                if arg.startswith("-listen=/unix/tmp/hivemind-p2pd-") and arg.endswith(".sock"):
                    self.sockets[arg[len("-listen=/unix/tmp/hivemind-p2pd-") : -len(".sock")]] = name

    def scan_sockets(self) -> None:
        table = procs.table()
        for inc in self.incs:
            if inc.alive:
                group = [procs.cmdline(pid) for pid, p in table.items() if p.pgid == inc.peer.pid]
                self.note_sockets(group, inc.peer.pid)

    def check_orphans(self, inc: Inc, before: dict[int, str], rec: dict[str, Any]) -> None:
        left = {p: c for p, c in self.group_pids(inc.peer.pid).items() if p in before and p != inc.peer.pid}
        left = {p: c for p, c in left.items() if procs.alive(p)}
        rec["group_left_after_kill"] = len(left)
        if left:
            self.orphans_after_kill.append({"inc": inc.name, "fault": rec["id"], "procs": left})
            self.finding("orphan_after_kill", inc, procs=left)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(inc.peer.pid, signal.SIGKILL)

    # -- main loop ----------------------------------------------------------------------------

    def run(self, state: dict[str, Any]) -> None:
        a = self.args
        self.build()
        wait = ("--wait-for-peers", str(a.initial))  # the initial peers start training together
        first = self.start(self.machines[0], "initial", fresh=True, with_config=True, first=True, extra=wait)
        assert first is not None
        while first.t_up is None:
            self.poll()
            if not first.alive:
                raise RuntimeError("the first peer exited:\n" + first.peer.tail())
            if self.now() > 240:
                raise RuntimeError("the first peer did not come up in 240 s:\n" + first.peer.tail())
            time.sleep(0.25)
        for m in self.machines[1 : a.initial]:
            self.start(m, "initial", fresh=True, with_config=True, extra=wait)
        # Faults begin once the initial peers trained a round (or after a minute, whatever they did).
        warm_end = self.now() + 120
        while self.now() < warm_end and sum(1 for i in self.incs if i.rounds_seen >= 2) < min(a.initial, 2):
            self.poll()
            time.sleep(0.25)
        state["t_faults_begin"] = self.now()
        end = self.now() + a.minutes * 60
        self.next_fault = self.now() + self.rng.expovariate(1 / a.fault_every)
        last_save = self.now()
        self.log(f"chaos begins for {a.minutes:g} min")
        while self.now() < end:
            self.poll()
            while self.heap and self.heap[0][0] <= self.now():
                _, _, _, fn = heapq.heappop(self.heap)
                fn()
            if self.now() >= self.next_fault:
                if self.draw():
                    self.next_fault = self.now() + self.rng.expovariate(1 / a.fault_every)
                else:  # nothing can be done without passing the floor or the ceiling: try again soon
                    self.infeasible += 1
                    self.next_fault = self.now() + 1.0
            self.refill()
            if self.now() - self.last_scan > 10:
                self.last_scan = self.now()
                self.scan_sockets()
            if not self.timeline or self.now() - self.timeline[-1][0] >= 5:
                self.timeline.append((round(self.now(), 1), len(self.live()), len(self.alive()), *machine_load()))
            if self.now() - last_save > 60 and a.out:
                last_save = self.now()
                state["partial"] = True
                _harness.write_json(a.out, self.report(state), default=str)
            time.sleep(0.2)
        self.wind_down(state)

    def wind_down(self, state: dict[str, Any]) -> None:
        """End of the chaos: let the stopped go, restore the links, drop what is scheduled, stop everyone."""
        self.chaos_end = self.now()
        state["chaos_end"] = self.chaos_end
        self.log("chaos over: SIGCONT, links restored, settling")
        for inc in self.incs:
            if inc.alive and inc.stopped:
                inc.peer.send_signal(signal.SIGCONT, group=True)
                inc.stopped = False
        for m in self.machines:
            if m.shaped:
                base = None if m.rate == "none" else m.rate
                with contextlib.suppress(Exception):
                    m.host.shape(up=base, down=base)
                m.shaped = False
            if m.clock is not None:
                m.clock.step(0.0)
                m.clock_stepped = False
            if m.disk is not None:
                with contextlib.suppress(OSError):
                    (m.disk / "filler").unlink()
                m.disk_full = False
        for inc in self.incs:
            inc.drop_armed = None
        # orphan checks still due run now-ish; restarts and rejoins are dropped
        for t, _, what, fn in sorted(self.heap):
            if what == "orphan check":
                while self.now() < t:
                    time.sleep(0.2)
                fn()
        self.heap.clear()
        settle_end = self.now() + self.args.settle
        while self.now() < settle_end:
            self.poll()
            time.sleep(0.25)
        final = [i for i in self.incs if i.alive]
        t_stop = self.now()
        for inc in final:
            if inc.cause is None:
                inc.cause, inc.t_signal = "final", t_stop
            inc.peer.send_signal(signal.SIGINT, group=True)
        deadline = time.monotonic() + self.args.final_grace
        while time.monotonic() < deadline and any(i.peer.poll() is None for i in final):
            time.sleep(0.25)
        for inc in final:
            rc = inc.peer.poll()
            if rc is None:
                self.finding("final_stop_hang", inc, after_s=self.args.final_grace)
                inc.peer.kill(group=True)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inc.peer.wait(10)
                rc = inc.peer.poll()
            self.exited_final(inc, rc)
        state["final_stop_s"] = round(self.now() - t_stop, 2)
        self.launcher.close()

    def exited_final(self, inc: Inc, rc: int | None) -> None:
        inc.events.extend(self.read(inc))
        inc.t_exit, inc.returncode = self.now(), rc
        if rc not in (0, None) and inc.cause == "final":
            self.finding("final_exit_nonzero", inc, returncode=rc)

    # -- report -------------------------------------------------------------------------------

    def report(self, state: dict[str, Any]) -> dict[str, Any]:
        for inc in self.incs:  # whatever the logs hold by now (also after an interrupt)
            if inc.t_exit is None:
                inc.events.extend(self.read(inc))
        spec = RunSpec.load(self.spec_path)
        return analyse(self, spec, state)


def machine_load() -> tuple[float, int]:
    """The 1-minute load average and the MB of memory available (others' jobs share this machine)."""
    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
        avail = next(
            int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable")
        )
        return load, avail // 1024
    except (OSError, ValueError, StopIteration, IndexError):
        return math.nan, -1


# ------------------------------------------------------------------------------------ analysis


def impaired_intervals(c: Chaos, end: float) -> dict[str, list[tuple[float, float, str]]]:
    """Per identity key (machine, generation): the intervals in which a fault had it out of action."""
    iv: dict[str, list[tuple[float, float, str]]] = {}
    first_round_after: dict[str, list[float]] = {}
    for inc in c.incs:
        rounds = [e["time"] - c.t0 for e in inc.events if e.get("event") == "round"]
        if rounds:
            first_round_after.setdefault(inc.key, []).append(rounds[0])
        # from its start until its first round a peer is joining (it may not answer)
        joined = rounds[0] if rounds else (inc.t_exit if inc.t_exit is not None else end)
        iv.setdefault(inc.key, []).append((inc.t_start, joined, f"joining:{inc.how}"))
        if inc.t_signal is not None and inc.cause not in (None, "final"):
            iv[inc.key].append((inc.t_signal, end, inc.cause))  # cut at its next incarnation's first round below
    for k, lst in iv.items():
        firsts = sorted(first_round_after.get(k, []))
        fixed = []
        for a, b, why in lst:
            if why.startswith("sig"):
                nxt = [f for f in firsts if f > a]
                b = nxt[0] if nxt else end
            fixed.append((a, b, why))
        iv[k] = fixed
    for f in c.faults:
        if f["kind"] in ("stop_cont", "slow_link", "link_drop") and "key" in f:
            iv.setdefault(f["key"], []).append((f["t"], f.get("t_end", end), f["kind"]))
        elif f["kind"] == "clock_step" and "machine" in f:
            # the machine's clock: whichever identity runs there meanwhile is faulted
            for key in {i.key for i in c.incs if i.key.startswith(f"m{f['machine']}g")}:
                iv.setdefault(key, []).append((f["t"], f.get("t_end", end), f["kind"]))
    # disk_full does not impair: a peer with a full disk must go on exchanging (its misses count as unexplained)
    return iv


def _hit(iv: list[tuple[float, float, str]], a: float, b: float) -> list[str]:
    return [why for x, y, why in iv if x <= b + IMPAIR_SLACK_S and y >= a - IMPAIR_SLACK_S]


def analyse(c: Chaos, spec: RunSpec, state: dict[str, Any]) -> dict[str, Any]:
    now = c.now()
    end = state.get("chaos_end") or now
    iv = impaired_intervals(c, now)
    key_of = {i.peer_id: i.key for i in c.incs if i.peer_id}
    net = spec.network
    exch = Counter()
    lost = Counter()
    lost_rows: list[dict[str, Any]] = []
    unexplained_misses: list[dict[str, Any]] = []
    stalls: list[dict[str, Any]] = []
    over_deadline = Counter()
    per_inc = []
    for inc in c.incs:
        rounds = [e for e in inc.events if e.get("event") == "round" and e["time"] - c.t0 <= end]
        # whose payload of round j was applied: the "screened" event of round j (its senders)
        arrived = {
            (e.get("round"), q) for e in inc.events if e.get("event") == "screened" for q in e.get("senders") or []
        }
        arrived |= {(e.get("round"), e.get("peer")) for e in inc.events if e.get("event") == "exchange"}
        screened = {e.get("round") for e in inc.events if e.get("event") == "screened"}
        own = iv.get(inc.key, [])
        # event k (round j+1) planned exchange j with its partners; event k+1 (round j+2) says how many answered
        for k in range(len(rounds) - 1):
            e, nxt = rounds[k], rounds[k + 1]
            if nxt.get("round") != e.get("round", 0) + 1:
                continue
            j = e["round"] - 1
            partners = e.get("partners") or []
            if not partners:
                continue
            a, b = e["time"] - c.t0, nxt["time"] - c.t0
            self_hit = _hit(own, a, b)
            answered = nxt.get("answered") or 0
            # who: the partners with no "exchange" event for round j; how many: the next event's answered
            no_event = [q for q in partners if (j, q) not in arrived]
            n_missed = max(0, len(partners) - answered)
            if j in screened and len(no_event) != n_missed:
                exch["answered_vs_screened_mismatch"] += 1
            missed = (no_event + [q for q in partners if q not in no_event])[:n_missed]
            exch["planned"] += len(partners)
            exch["arrived"] += len(partners) - len(missed)
            for q in missed:
                q_hit = _hit(iv.get(key_of.get(q, ""), []), a, b)
                cls = "own" if self_hit else "partner_faulted" if q_hit else "unexplained"
                exch[f"missed_{cls}"] += 1
                if cls == "unexplained" and len(unexplained_misses) < 200:
                    unexplained_misses.append(
                        {"inc": inc.name, "round": j, "partner": q, "partner_key": key_of.get(q), "t": round(a, 2)}
                    )
            if answered == 0:
                partner_hits = [_hit(iv.get(key_of.get(q, ""), []), a, b) for q in partners]
                cls = "own" if self_hit else "collateral" if all(partner_hits) else "unexplained"
                lost[cls] += 1
                lost_rows.append(
                    {
                        "inc": inc.name,
                        "round": j,
                        "t": round(a, 2),
                        "class": cls,
                        "partners": [key_of.get(q, q[-8:]) for q in partners],
                        "own_faults": self_hit,
                        "partner_faults": partner_hits,
                    }
                )
        gaps = [rounds[k]["time"] - rounds[k - 1]["time"] for k in range(1, len(rounds))]
        expected = statistics.median(gaps) if gaps else None
        if expected:
            deadline = expected + net.stall_timeout_s + expected / 4
            for k in range(1, len(rounds)):
                g = gaps[k - 1]
                a, b = rounds[k - 1]["time"] - c.t0, rounds[k]["time"] - c.t0
                self_hit = _hit(own, a, b)
                partners = rounds[k - 1].get("partners") or []
                p_hits = [h for q in partners for h in _hit(iv.get(key_of.get(q, ""), []), a, b)]
                cls = "faulted" if self_hit else "non_faulted_partner_faulted" if p_hits else "non_faulted_clean"
                if g > deadline:
                    over_deadline[cls] += 1
                stalls.append(
                    {
                        "inc": inc.name,
                        "round": rounds[k].get("round"),
                        "t": round(a, 2),
                        "gap_s": round(g, 2),
                        "expected_s": round(expected, 2),
                        "deadline_s": round(deadline, 2),
                        "over_deadline_s": round(g - deadline, 2),
                        "class": cls,
                        "own_faults": self_hit,
                        "partners": [key_of.get(q, q[-8:]) for q in partners],
                        "partner_faults": p_hits,
                    }
                )
            if inc.alive or (inc.t_exit or 0) > end:  # the tail: no round since the last one, up to the end
                last = rounds[-1]["time"] - c.t0 if rounds else None
                if last is not None and inc.t_up is not None and not _hit(own, last, end):
                    tail = end - last
                    if tail > deadline:
                        over_deadline["non_faulted_tail"] += 1
                        stalls.append(
                            {
                                "inc": inc.name,
                                "round": None,
                                "t": round(last, 2),
                                "gap_s": round(tail, 2),
                                "expected_s": round(expected, 2),
                                "deadline_s": round(deadline, 2),
                                "over_deadline_s": round(tail - deadline, 2),
                                "class": "non_faulted_tail",
                                "own_faults": [],
                                "partners": [],
                            }
                        )
        fin = next((e for e in inc.events if e.get("event") == "finished"), None)
        left = next((e for e in inc.events if e.get("event") == "left"), None)
        leave = None
        if inc.t_signal is not None and inc.cause in ("sigint", "sigterm", "final"):
            rec = next((f for f in c.faults if f.get("inc") == inc.name and f["kind"].startswith("leave")), {})
            leave = {
                "signal": rec.get("signal", "SIGINT"),
                "group": rec.get("group", True),
                "signal_to_left_s": left and round(left["time"] - c.t0 - inc.t_signal, 2),
                "left_to_finished_s": left and fin and round(fin["time"] - left["time"], 2),
                "finished_to_exit_s": fin and inc.t_exit and round(inc.t_exit - (fin["time"] - c.t0), 2),
                "signal_to_exit_s": inc.t_exit and round(inc.t_exit - inc.t_signal, 2),
                "undelivered": len(left.get("undelivered") or []) if left else None,
            }
        lag = None
        if rounds and inc.how != "initial":
            t1, r0 = rounds[0]["time"], rounds[0].get("round", 0)
            others = [
                e.get("round", 0)
                for o in c.incs
                if o is not inc
                for e in o.events
                if e.get("event") == "round" and t1 - 15 <= e["time"] <= t1
            ]
            lag = (max(others) - r0) if others else None
        tb = "Traceback" in (inc.peer.err.read_text(errors="replace") if inc.peer.err.exists() else "")
        per_inc.append(
            {
                "inc": inc.name,
                "key": inc.key,
                "how": inc.how,
                "with_config": inc.with_config,
                "peer_id": inc.peer_id,
                "t_start": round(inc.t_start, 2),
                "t_up": inc.t_up and round(inc.t_up, 2),
                "t_exit": inc.t_exit and round(inc.t_exit, 2),
                "t_signal": inc.t_signal and round(inc.t_signal, 3),
                "returncode": inc.returncode,
                "cause": inc.cause,
                "rounds": len(rounds),
                "first_round": rounds[0].get("round") if rounds else None,
                "last_round": rounds[-1].get("round") if rounds else None,
                "expected_round_s": expected and round(expected, 3),
                "resumed": next((e.get("resumed") for e in inc.events if e.get("event") == "started"), None),
                "synced": [e for e in inc.events if e.get("event") == "synced"],
                "sync_failed": [e for e in inc.events if e.get("event") == "sync_failed"],
                "checkpoint_set_aside": [e for e in inc.events if e.get("event") == "checkpoint_set_aside"],
                "left": next((e for e in inc.events if e.get("event") == "left"), None),
                "finished": {
                    k: fin.get(k)
                    for k in (
                        "rounds_completed",
                        "exchanges_ok",
                        "exchanges_failed",
                        "gave_up",
                        "gone_skipped",
                        "faults",
                    )
                }
                if fin
                else None,
                "traceback": tb,
                "leave": leave,
                "join_lag_rounds": lag,
            }
        )
    fin_tot = Counter()
    for p in per_inc:
        if p["finished"]:
            fin_tot["finished_summaries"] += 1
            for k in ("exchanges_ok", "exchanges_failed", "gave_up", "gone_skipped"):
                fin_tot[k] += p["finished"].get(k) or 0
    crashes = [f for f in c.findings if f["kind"] in ("unexpected_exit", "leave_exit_nonzero", "final_exit_nonzero")]
    tracebacks = [
        {
            "inc": p["inc"],
            "cause": p["cause"],
            "returncode": p["returncode"],
            "exceptions": _exceptions(c.folder / f"{p['inc']}.err"),
            "tail": _traceback_tail(c.folder / f"{p['inc']}.err"),
        }
        for p in per_inc
        if p["traceback"]
    ]
    corrupt = []
    for f in c.faults:
        if f["kind"] == "corrupt_restart":
            # the incarnations of that identity from the restart on, up to the first that came up
            later = [p for p in per_inc if p["key"] == f.get("key") and p["t_start"] >= f["t"]]
            upto = next((k for k, p in enumerate(later) if p["t_up"] is not None), len(later) - 1)
            seen = later[: upto + 1]
            nxt = {
                "checkpoint_set_aside": [e for p in seen for e in p["checkpoint_set_aside"]],
                "synced": [e for p in seen for e in p["synced"]],
                "sync_failed": [e for p in seen for e in p["sync_failed"]],
                "resumed": seen[-1]["resumed"] if seen else None,
                "incs": [p["inc"] for p in seen],
            }
            corrupt.append(
                {
                    "fault": f["id"],
                    "corrupted": f.get("corrupted"),
                    "restarted_as": f.get("restarted_as"),
                    "set_aside": bool(nxt and nxt["checkpoint_set_aside"]),
                    "synced": bool(nxt and nxt["synced"]),
                    "sync_failed": bool(nxt and nxt["sync_failed"]),
                    "resumed": nxt["resumed"],
                    "incarnations": nxt["incs"],
                }
            )
    stalls.sort(key=lambda s: -s["over_deadline_s"])
    nf = [s for s in stalls if s["class"] != "faulted"]
    clean = [s for s in stalls if s["class"] in ("non_faulted_clean", "non_faulted_tail")]
    counts = Counter(f["kind"] for f in c.faults)
    return {
        "bench": "chaos",
        "partial": bool(state.get("partial")) and not state.get("done"),
        "interrupted": bool(state.get("interrupted")),
        "error": state.get("error"),
        "seed": c.args.seed,
        "minutes": c.args.minutes,
        "config": str(c.args.config),
        "spec_hash": spec.hash(),
        "floor": c.args.floor,
        "ceiling": c.args.ceiling,
        "machines": c.args.machines,
        "rate": c.args.rate,
        "fault_every_s": c.args.fault_every,
        "spec_ttl_s": c.args.spec_ttl,
        "heartbeat_ttl_s": net.heartbeat_ttl_s,
        "stall_timeout_s": net.stall_timeout_s,
        "t_faults_begin": state.get("t_faults_begin"),
        "git_commit_start": state.get("git_commit_start"),
        "t0": c.t0,
        "chaos_end": state.get("chaos_end"),
        "chaos_s": round(end - (state.get("t_faults_begin") or 0), 1),
        "fault_counts": {k: counts.get(k, 0) for k in KINDS},
        "faults_total": len(c.faults),
        "joins": len(c.joins),
        "joins_after_spec_ttl_without_config": sum(1 for j in c.joins if j["after_spec_ttl"] and not j["with_config"]),
        "crashes": crashes,
        "crashes_non_faulted": [f for f in crashes if f["kind"] == "unexpected_exit"],
        "tracebacks": tracebacks,
        "findings": c.findings,
        "orphans_after_kill": c.orphans_after_kill,
        "exchanges_from_logs": dict(exch),
        "lost_rounds": dict(lost),
        "lost_rounds_rows": lost_rows[:400],
        "unexplained_misses": unexplained_misses,
        "rounds_over_deadline": dict(over_deadline),
        "longest_stall": stalls[0] if stalls else None,
        "longest_stall_non_faulted": nf[0] if nf else None,
        "longest_stall_clean": clean[0] if clean else None,
        "top_stalls": stalls[:25],
        "corrupt_restarts": corrupt,
        "leaves": [{"inc": p["inc"], **p["leave"]} for p in per_inc if p["leave"]],
        "joins_behind": [
            {"inc": p["inc"], "how": p["how"], "first_round": p["first_round"], "lag_rounds": p["join_lag_rounds"]}
            for p in per_inc
            if (p["join_lag_rounds"] or 0) >= 3
        ],
        "infeasible_draws": c.infeasible,
        "weights": c.weights,
        "kinds_not_drawn": getattr(c, "skipped", {}),
        "disk_mb": getattr(c.args, "disk_mb", 0),
        "sync_events": {k: sum(len(p[k]) for p in per_inc) for k in ("synced", "sync_failed", "checkpoint_set_aside")},
        "longest_gap": max(stalls, key=lambda s: s["gap_s"]) if stalls else None,
        "p2pd_sockets_seen": len(c.sockets),
        "p2pd_sockets_left": state.get("sockets_left"),
        "finished_totals": dict(fin_tot),
        "orphans": state.get("orphans"),
        "leftover_netns": state.get("leftover_netns"),
        "leftover_tmp": state.get("leftover_tmp"),
        "new_hivemind_sockets_in_tmp": state.get("new_hivemind_sockets"),
        "final_stop_s": state.get("final_stop_s"),
        "live_timeline": c.timeline,
        "load_max": max((x[3] for x in c.timeline), default=None),
        "mem_available_min_mb": min((x[4] for x in c.timeline), default=None),
        "faults": c.faults,
        "join_records": c.joins,
        "incarnations": per_inc,
    }


def _exceptions(path: Path) -> dict[str, int]:
    """The exception lines that end each traceback in a stderr file, with counts ('unretrieved': hivemind's
    'Task exception was never retrieved' preamble)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: Counter = Counter()
    for k, line in enumerate(lines):
        if line.startswith("Traceback"):
            pre = "unretrieved: " if k and "never retrieved" in "".join(lines[max(0, k - 3) : k]) else ""
            end = next((x for x in lines[k + 1 :] if x and not x.startswith((" ", "Traceback"))), "?")
            out[pre + end[:200]] += 1
    return dict(out)


def _traceback_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    i = text.rfind("Traceback")
    return text[max(0, i - 200) : i + 2500] if i >= 0 else ""


def scan_orphans(tag: str, folder: Path) -> list[dict[str, Any]]:
    """Processes of this run still alive: the marker in their environment, or the folder in their argv."""
    out = []
    needle, fold = f"{MARKER}={tag}".encode(), str(folder).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if (needle in env.split(b"\0") or fold in cmd) and procs.alive(int(d.name)):
            out.append({"pid": int(d.name), "cmdline": cmd.replace(b"\0", b" ").decode(errors="replace")[:300]})
    return out


def leftover_tmp(tmpdir: Path) -> list[str]:
    """What the peers left in their TMPDIR: torch's cache aside, and of locomm's own folder of p2pd records
    (locomm/peer/transport/leftovers.py: it stays, records of killed peers' daemons are swept by the next start)
    only the records still in it."""
    out = []
    for p in tmpdir.iterdir():
        if p.name.startswith("torchinductor_"):
            continue
        if p.name == f"locomm-{os.getuid()}":
            out += sorted(f"{p.name}/{r.relative_to(p)}" for r in p.rglob("*") if r.is_file())
        else:
            out.append(p.name)
    return sorted(out)


def hivemind_sockets() -> set[str]:
    return {p.name for p in Path("/tmp").glob("hivemind-*")}


# ------------------------------------------------------------------------------------ table


def table(r: dict[str, Any]) -> str:
    lines = [
        f"chaos: {r['chaos_s']} s of faults, seed {r['seed']}, floor {r['floor']} ceiling {r['ceiling']}"
        + (" (INTERRUPTED)" if r["interrupted"] else "")
        + (f" (error: {r['error']})" if r["error"] else ""),
        f"{'fault kind':<20}{'count':>7}",
    ]
    for k, v in r["fault_counts"].items():
        lines.append(f"{k:<20}{v:>7}")
    lines.append(f"{'total':<20}{r['faults_total']:>7}")
    ls, ex, ft = r["lost_rounds"], r["exchanges_from_logs"], r["finished_totals"]
    nf = r["longest_stall_non_faulted"]
    cl = r["longest_stall_clean"]
    st = r["longest_stall"]
    lines += [
        f"joins: {r['joins']} ({r['joins_after_spec_ttl_without_config']} without --config after the spec TTL)",
        f"crashes of non-faulted peers: {len(r['crashes_non_faulted'])}; other crash findings: "
        f"{len(r['crashes']) - len(r['crashes_non_faulted'])}; stderr tracebacks: {len(r['tracebacks'])}",
        f"lost rounds (no partner payload): own {ls.get('own', 0)}, collateral {ls.get('collateral', 0)}, "
        f"unexplained {ls.get('unexplained', 0)}",
        f"partner payloads: planned {ex.get('planned', 0)}, arrived {ex.get('arrived', 0)}, missed own "
        f"{ex.get('missed_own', 0)} / partner faulted {ex.get('missed_partner_faulted', 0)} / unexplained "
        f"{ex.get('missed_unexplained', 0)}",
        f"rounds over deadline: {r['rounds_over_deadline']}",
        "longest stall: "
        + (
            f"{st['gap_s']} s ({st['inc']} round {st['round']}, deadline {st['deadline_s']} s, {st['class']})"
            if st
            else "-"
        ),
        "longest stall of a non-faulted peer: "
        + (
            f"{nf['gap_s']} s ({nf['inc']} round {nf['round']} at {nf['t']} s, deadline {nf['deadline_s']} s)"
            if nf
            else "-"
        ),
        "longest stall with neither the peer nor its partners faulted: "
        + (
            f"{cl['gap_s']} s ({cl['inc']} round {cl['round']} at {cl['t']} s, deadline {cl['deadline_s']} s)"
            if cl
            else "-"
        ),
        f"finished summaries {ft.get('finished_summaries', 0)}: exchanges ok {ft.get('exchanges_ok', 0)} failed "
        f"{ft.get('exchanges_failed', 0)}, gave_up {ft.get('gave_up', 0)}, gone_skipped {ft.get('gone_skipped', 0)}",
        f"joins behind the swarm (>= 3 rounds): {len(r['joins_behind'])}; corrupt restarts set aside: "
        f"{sum(1 for x in r['corrupt_restarts'] if x['set_aside'])}/{len(r['corrupt_restarts'])}",
        f"leaves: {len(r['leaves'])}, slowest signal->exit "
        f"{max((x['signal_to_exit_s'] or 0 for x in r['leaves']), default=0)} s",
        f"p2pd sockets left in /tmp: {len(r['p2pd_sockets_left'] or [])} of {r['p2pd_sockets_seen']} seen",
        f"orphans after kill: {len(r['orphans_after_kill'])}; orphans at the end: {len(r['orphans'] or [])}; "
        f"leftover netns: {len(r['leftover_netns'] or [])}; leftover tmp entries: {len(r['leftover_tmp'] or [])}",
        f"state sync: {r['sync_events']}",
        f"findings: {dict(Counter(f['kind'] for f in r['findings']))}",
    ]
    for k, why in (r.get("kinds_not_drawn") or {}).items():
        lines.append(f"not drawn: {k} ({why})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _harness.parser(__doc__.split("\n\n")[0], out="chaos.json")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--minutes", type=float, default=3.0, help="How long faults are injected")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--floor", type=int, default=3)
    ap.add_argument("--ceiling", type=int, default=6)
    ap.add_argument("--initial", type=int, default=5, help="Peers started before the faults begin")
    ap.add_argument("--machines", type=int, default=8, help="Namespaces (a peer each at a time)")
    ap.add_argument("--rate", default="50mbit", help="Every link's rate, up and down (none: unshaped)")
    ap.add_argument("--fault-every", type=float, default=5.5, help="Mean seconds between faults")
    ap.add_argument("--spec-ttl", type=float, default=SPEC_TTL_S, help="LOCOMM_SPEC_TTL_S of every peer")
    ap.add_argument("--settle", type=float, default=20.0, help="Seconds without faults before the final stop")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--final-grace", type=float, default=60.0, help="Seconds the peers get to leave at the end")
    ap.add_argument("--keep", type=Path, help="Copy the peers' logs here")
    ap.add_argument(
        "--disk-mb", type=int, default=0, help="A tmpfs of this size per machine for its checkpoints (0: none)"
    )
    ap.add_argument("--weights", nargs="*", metavar="KIND=W", help="Override fault weights (e.g. corrupt_restart=1)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--reanalyse", type=Path, metavar="JSON", help="Analyse a finished run again: its JSON and --keep logs"
    )
    args = ap.parse_args(argv)
    if not 1 <= args.floor <= args.ceiling <= args.machines or not args.floor <= args.initial <= args.ceiling:
        ap.error("need 1 <= floor <= initial <= ceiling <= machines")
    return args


class _Peer:
    def __init__(self, err: Path) -> None:
        self.err = err

    def tail(self, chars: int = 3000) -> str:
        return self.err.read_text(errors="replace")[-chars:] if self.err.exists() else ""


def reanalyse(old: Path, logs: Path, out: Path | None) -> int:
    """Run the analysis again on a finished run: its JSON (faults, incarnations, findings) and its kept logs
    (``--keep``). The start time t0 is taken from the JSON, or else recovered from the 'started' events."""
    r = json.loads(old.read_text())
    args = argparse.Namespace(**{k: r.get(k) for k in ("seed", "minutes", "floor", "ceiling", "machines", "rate")})
    args.config, args.fault_every, args.spec_ttl = r["config"], r["fault_every_s"], r["spec_ttl_s"]
    c = Chaos.__new__(Chaos)
    c.args, c.folder, c.faults, c.findings = args, logs, r["faults"], r["findings"]
    c.orphans_after_kill, c.timeline, c.joins = r["orphans_after_kill"], r["live_timeline"], r["join_records"]
    c.infeasible, c.weights = r["infeasible_draws"], r["weights"]
    c.sockets = {str(k): "" for k in range(r["p2pd_sockets_seen"])}
    c.incs = []
    for p in r["incarnations"]:
        inc = types.SimpleNamespace()  # what analyse() reads of an Inc
        inc.name, inc.key, inc.how, inc.with_config = p["inc"], p["key"], p["how"], p["with_config"]
        inc.peer_id, inc.t_start, inc.t_up, inc.t_exit = p["peer_id"], p["t_start"], p["t_up"], p["t_exit"]
        inc.returncode, inc.cause, inc.peer = p["returncode"], p["cause"], _Peer(logs / f"{p['inc']}.err")
        inc.events = [e for e in _read(logs / f"{p['inc']}.jsonl") if e.get("event") in KEPT_EVENTS]
        inc.t_signal = p.get("t_signal")
        if inc.t_signal is None and inc.cause not in (None, "final"):  # older JSON: the fault's time
            ended = ("kill_restart", "kill_starting", "corrupt_restart", "leave_exchanging", "leave_random")
            f = next((f for f in r["faults"] if f.get("inc") == inc.name and f["kind"] in ended), None)
            inc.t_signal = f["t"] if f else None
        inc.alive = inc.t_exit is None
        c.incs.append(inc)
    if r.get("t0"):
        c.t0 = r["t0"]
    else:  # the poll that saw 'started' came at most a poll interval after the event
        c.t0 = max(e["time"] - i.t_up for i in c.incs for e in i.events if e.get("event") == "started" and i.t_up)
    chaos_end = r.get("chaos_end") or (r["t_faults_begin"] + r["chaos_s"])
    for inc in c.incs:
        if inc.cause == "final" and inc.t_signal is None:
            inc.t_signal = chaos_end
    state = {k: r.get(k) for k in ("t_faults_begin", "git_commit_start", "orphans", "leftover_netns", "leftover_tmp")}
    state |= {"chaos_end": chaos_end, "done": True, "interrupted": r["interrupted"], "error": r["error"]}
    state |= {"new_hivemind_sockets": r["new_hivemind_sockets_in_tmp"], "sockets_left": r["p2pd_sockets_left"]}
    state["final_stop_s"] = r["final_stop_s"]
    spec = RunSpec.load(logs / "run.toml")
    result = analyse(c, spec, state)
    result["reanalysed_from"] = {"json": str(old), "logs": str(logs), "t0_recovered": not r.get("t0")}
    result["platform_of_run"] = r.get("platform")
    if out:
        _harness.write_json(out, result, default=str)
    print(table(result), flush=True)
    return 0


def _read(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                if isinstance(e, dict):
                    out.append(e)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyse:
        if not args.keep:
            print("error: --reanalyse needs --keep (the folder of the run's logs)", file=sys.stderr)
            return 2
        return reanalyse(args.reanalyse, args.keep, args.out)
    ok, why = netlab.available()
    if not ok:
        print(f"error: netlab unavailable: {why}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="locomm-chaos-"))
    spec = RunSpec.load(args.config)
    spec_path = folder / "run.toml"
    spec.save(spec_path)
    socks_before = hivemind_sockets()
    state: dict[str, Any] = {"git_commit_start": _harness.platform_info().get("git_commit")}
    chaos: Chaos | None = None
    code = 0
    lab = netlab.Lab(grace_s=10.0)
    try:
        with lab:
            chaos = Chaos(args, lab, folder, spec_path)
            try:
                chaos.run(state)
            finally:
                chaos.launcher.close()
    except (KeyboardInterrupt, SystemExit) as e:
        state["interrupted"] = True
        code = 130 if isinstance(e, KeyboardInterrupt) else (e.code if isinstance(e.code, int) else 1)
    except Exception as e:  # noqa: BLE001 - still write what we have
        import traceback  # noqa: PLC0415

        state["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        code = 1
    finally:
        if chaos is not None:
            time.sleep(1.0)
            orphans = scan_orphans(chaos.tag, folder)
            for o in orphans:  # ours: stop them, after recording them
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(o["pid"], signal.SIGKILL)
            state["orphans"] = orphans
            state["leftover_netns"] = [n for n in netlab.list_netns() if n.startswith(lab.run_name)]
            state["leftover_tmp"] = leftover_tmp(chaos.tmpdir)
            state["sockets_left"] = sorted(
                f"{kind}-{uid}.sock ({inc})"
                for uid, inc in chaos.sockets.items()
                for kind in ("hivemind-p2pd", "hivemind-p2pclient")
                if Path(f"/tmp/{kind}-{uid}.sock").exists()
            )
            state["new_hivemind_sockets"] = sorted(hivemind_sockets() - socks_before)
            for mnt in chaos.mounts:
                subprocess.run(["umount", "-l", str(mnt)], check=False)
            state["done"] = True
            result = chaos.report(state)
            if args.out:
                _harness.write_json(args.out, result, default=str)
            print(table(result), flush=True)
        if args.keep:
            shutil.copytree(folder, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("ckpt", "tmp", "disk"))
        shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

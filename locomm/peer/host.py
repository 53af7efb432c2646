"""One host for every peer mode: P2P and the DHT node, the settled spec, the RPC server, heartbeats,
metrics, the event log and shutdown.

A driver (the data-parallel ``dataparallel.node.Node``, the pipeline ``pipeline.stage.Stage``)
composes a host; it does not inherit one::

    async with Host(spec, opts) as host:      # everything is up here; host.spec is the swarm's
        await host.serve(service, ...)        # add the driver's services
        host.heartbeat = driver.heartbeat     # what the heartbeat loop publishes from now on
        host.spawn(coro)                      # tasks the host awaits on exit
        ...

``__aenter__`` creates everything (so no attribute appears later, and no driver needs ``hasattr``);
``__aexit__`` stops every task the host started (they run in one ``asyncio.TaskGroup``), awaits them,
and shuts the services, the DHT node and p2pd down, in that order, whatever happened.

The heartbeat is the driver's: it hands the host a function that returns its current
:class:`~locomm.protocol.membership.Heartbeat`, and the host stores it every
``heartbeat_interval_s`` (and when asked, e.g. after each round).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P

from locomm.atomic import atomic_write_text
from locomm.compression.payload import PayloadCodec
from locomm.config import RunSpec
from locomm.peer.metrics import EventLog, Metrics
from locomm.peer.options import NodeOptions
from locomm.peer.spec_sync import settle_spec
from locomm.peer.trackers import Trackers
from locomm.peer.transport import dht_clock, hello, leftovers, peer_cache, reach
from locomm.peer.transport.gossip import Faults, Gossip
from locomm.peer.transport.paths import live_connections
from locomm.peer.transport.records import (
    SPEC_TTL_S,
    SwarmKey,
    SwarmValidator,
    heartbeat_ttl,
)
from locomm.peer.transport.rpc import RpcServer, Service
from locomm.peer.transport.shaper import Shaper
from locomm.peer.transport.state_sync import Judge, Synced, fetch_state
from locomm.peer.transport.swarm import (
    peer_ids_of,
    peers_key,
    publish_spec,
    read_heartbeats,
    store_heartbeat,
    stored_expiration,
)
from locomm.protocol.defence import Screened
from locomm.protocol.membership import MAX_CLOCK_SKEW_S, Heartbeat, netgroup, newer, observed_time
from locomm.protocol.sightings import Sightings
from locomm.protocol.timing import Limits

log = logging.getLogger(__name__)
SIGHT_WAIT_S = 2.0
"""How long a heartbeat read of a peer that is not yet a started member waits for its hellos to identities it has
not seen alive (they go on in the background up to ``hello.ASK_TIMEOUT_S``): a joiner's first view counts the
peers that answer within it. A member's reads (one per round) never wait: a newcomer's own hello to it counts
the newcomer at once, and a dead peer's lingering record would otherwise cost a round start this wait."""
COMPUTE_NICE = 10
"""How much lower than the rest of the peer the compute thread runs (Linux: per-thread nice, added to the
process's). The link is the exchange's bottleneck and idles while the CPU work that feeds it (p2pd, our encodes,
our partners' decodes) waits behind a forward pass; a round waits for both anyway, so that work goes first and
compute takes what is left. On a volunteer's desktop the training thread also yields to the user's programs.
Measured on 3 peers sharing 2 cores (docs/results/links.md): no change beyond the runs' spread."""


def _p2pd_running(p2p: P2P | None) -> bool:
    """Whether our p2pd still runs (False when it exited: killed, OOM, crashed)."""
    child = getattr(p2p, "_child", None)  # hivemind's asyncio Process of p2pd; None when we attached to one
    return p2p is not None and (child is None or child.returncode is None)


GOODBYE_ATTEMPTS = 4
"""Stores of the final heartbeat before a leaving peer gives up (the third and fourth 1 s apart): it must reach
a node other than ourselves ..."""
GOODBYE_S = 5.0
"""... within this long in all (the last peer of a swarm has nobody to tell, and leaving is bounded)."""


class Host:
    """A peer's runtime, shared by every driver (see the module docstring)."""

    def __init__(self, spec: RunSpec, opts: NodeOptions) -> None:
        self.spec = spec
        self.opts = opts
        self.stop = asyncio.Event()
        """Set by the first SIGINT/SIGTERM/SIGHUP (or the driver): finish the pending exchange, say goodbye."""
        self.hurry = asyncio.Event()
        """Set by a second signal: leave at once (no more waiting on exchanges or partners)."""
        self.events = EventLog(opts.log_file)
        self.trackers = Trackers(tensorboard=opts.tensorboard, wandb_project=opts.wandb)  # ConfigError: not installed
        if self.trackers.enabled:
            self.events.sinks.append(self.trackers)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="locomm-compute", initializer=lower_priority)
        self.codec_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="locomm-codec")
        self.beats: dict[str, Heartbeat] = {}
        """The heartbeats of the peers we have seen alive (``sightings``), and our own: all the drivers count."""
        self.records: dict[str, Heartbeat] = {}
        """Every heartbeat the last read returned, seen alive or not."""
        self.sightings = Sightings()
        self._round_now: int | None = None
        """Our round as our last heartbeat said, once we are a started, admitted member (what a sighting notes)."""
        self.heartbeat: Callable[[], Heartbeat] | None = None
        """The driver's current heartbeat; None until the driver sets it (then the loop publishes it)."""
        self.on_close: list[Callable[[], Any]] = []
        """Blocking clean-ups of the driver's (e.g. DiLoCo's averager), run in a thread before the DHT stops."""
        self.t_launch = time.perf_counter()
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task] = set()
        self._refresh: asyncio.Task | None = None
        self._unknown_read = 0.0
        self._newest: dict[str, Heartbeat] = {}
        self._stored_until = 0.0
        """The expiration (DHT time) of the last heartbeat record we stored: the next one expires later."""
        self._pace: dict[str, tuple[int, float, int, float]] = {}
        """Per peer, the round counter seen first and last on our monotonic clock: its pace as we observed it."""
        self._heard: dict[str, tuple[float, float, float]] = {}
        """Per peer, its record's own time, that time on our clock, and when we read it (``observed_time``)."""
        self._spec_stored = -math.inf
        self._remembered = -math.inf
        self._remembered_peers: frozenset[str] = frozenset()
        self._id_dir: Path | None = None
        self._p2pd_record: Path | None = None
        self.swarm_key: SwarmKey | None = None
        """This swarm's key (``opts.swarm_key`` read), or None in an open swarm."""
        self.identity: Path
        """The identity file P2P runs with (its key signs every record this host writes)."""
        self.validator: SwarmValidator
        """The DHT's record validator: signs our records, checks everyone's (``peer/transport/records.py``)."""
        self.p2p: P2P
        self.dht: DHTNode
        self.me: str
        self.incarnation = secrets.token_hex(8)
        """This process's start, in every heartbeat: partners waiting on our payloads see a restart as one."""
        self.maddrs: list[Any]
        self.run_id: str
        self.limits: Limits
        self.faults: Faults
        self.rpc: RpcServer
        self.metrics: Metrics

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Host:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal or ssh session closed
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
            loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # `kill -USR1 PID`: where each task waits
        loop.set_exception_handler(dht_clock.quiet_refusals(loop.get_exception_handler()))
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        try:
            initial = list(self.opts.initial_peers) or None
            self.swarm_key = SwarmKey.load(self.opts.swarm_key) if self.opts.swarm_key else None
            self.identity, self._id_dir = reach.identity_path(self.opts, self.swarm_key)
            known = not initial or self.opts.spec_from_user  # this run's keys are guarded from the start
            await asyncio.to_thread(leftovers.sweep)  # sockets of killed peers' p2pd (their records only)
            dht_clock.install()  # hivemind's DHT time is ours: the wall clock and the offset the swarm agrees on
            boot = initial
            if initial and self.opts.checkpoint_dir is not None:  # a restart: the peers it saw last, after the user's
                boot = list(dict.fromkeys([*initial, *peer_cache.recall(self.opts.checkpoint_dir)]))
            got = await reach.reach(
                self.opts,
                self.spec,
                self.identity,
                self.swarm_key,
                boot=boot,
                known=known,
                stop=self.stop,
                on_event=self.events.write,
            )
            self.p2p, self.dht, self.validator, self.me = got.p2p, got.dht, got.validator, got.me
            self.maddrs, self._p2pd_record = got.maddrs, got.record
            if initial:  # on the swarm's time before our first record: a machine whose clock stepped joins on it
                with contextlib.suppress(Exception):  # a clock check never stops a start
                    await dht_clock.check(self.dht, self.events.write)
            self.spawn(dht_clock.keep(self.dht, self.stop, self.events.write), background=True)
            if self._id_dir is not None:  # a throwaway key, now in p2pd and the validator: no file outlives a kill
                shutil.rmtree(self._id_dir, ignore_errors=True)
            self.spec = await settle_spec(self.dht, self.opts, self.spec, self.swarm_key, self.events.write)
            await self.publish_spec()
            net = self.spec.network
            self.run_id = self.spec.hash()[:16]
            if self.trackers.enabled:
                await asyncio.to_thread(self.trackers.start, self.run_id, self.me, self.spec.to_dict())
            if not known:
                self.validator.set_run(self.run_id, net.heartbeat_ttl_s)
                self._forget_unchecked(peers_key(self.run_id))
            self.limits = Limits.from_network(net)
            self.faults = Faults(net.max_faults_before_ban, on_ban=self._banned)
            (shaper := Shaper(self.opts.max_upload_mbit, self.opts.max_download_mbit)).check(net)  # cap >= floor
            self.rpc = RpcServer(
                self.p2p,
                self.run_id,
                self.limits,
                self.codec_pool,
                authorize=self.authorize,
                is_banned=self.faults.is_banned,
                on_fault=self.faults.record,
                shaper=shaper,
            )
            await hello.serve(self.p2p, self.run_id, self._sighted)
            await hello.serve_seen(self.p2p, self.run_id, self.sightings.ages, lambda p: self.authorize(p, "announced"))
            self.metrics = Metrics(self.opts.metrics_port, self.me, host=self.opts.metrics_host)
        except BaseException as e:
            await self.__aexit__(type(e), e, e.__traceback__)
            raise
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop.set()
        for task in list(self._tasks):
            task.cancel()
        try:
            if self._tg is not None:
                tg, self._tg = self._tg, None
                try:
                    await tg.__aexit__(exc_type, exc, tb)
                except BaseExceptionGroup as eg:  # a task's own error: raise it, not the group
                    # (the group cancelled the driver's body for it, so ``exc`` is then that CancelledError)
                    first = next((e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError)), None)
                    if first is not None:
                        raise first from (None if exc is None or isinstance(exc, asyncio.CancelledError) else exc)
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        for fn in self.on_close:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(fn)
        if hasattr(self, "metrics"):
            self.metrics.close()
        for name in ("dht", "p2p"):
            svc = getattr(self, name, None)
            if name == "dht" and not _p2pd_running(getattr(self, "p2p", None)):
                continue  # its shutdown unregisters handlers in p2pd: with p2pd dead (killed, OOM) it waits 10 s
            if svc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(svc.shutdown(), 10)
        if getattr(self, "p2p", None) is not None:
            leftovers.forget(self._p2pd_record, self.p2p)
        self.pool.shutdown(wait=True)
        self.codec_pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.to_thread(self.trackers.close), 30)
        self.events.close()
        if self._id_dir is not None:
            shutil.rmtree(self._id_dir, ignore_errors=True)

    def _on_signal(self, sig: int) -> None:
        if self.stop.is_set():
            log.warning("%s again: leaving at once", signal.Signals(sig).name)
            self.hurry.set()
        else:
            name = signal.Signals(sig).name
            log.info("%s: finishing the pending exchange, then leaving (again: leave at once)", name)
        self.stop.set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, background: bool = False) -> asyncio.Task:
        """Start a task the host stops and awaits on exit.

        With ``background`` an error is logged and the task ends (a missed heartbeat is not fatal); otherwise
        an error stops the whole host, as an error in the driver's own code would.
        """
        assert self._tg is not None, "the host is not running"
        if background:
            coro = _logged(coro)
        task = self._tg.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the spec ----------------------------------------------------------------------

    def _forget_unchecked(self, key: str) -> None:
        """Drop what this node stored or cached for ``key`` before its validator guarded it (a joiner learns
        its run from the swarm after its DHT node is up); it is read again, checked, from the others."""
        key_id = DHTID.generate(source=key)
        for store in (self.dht.protocol.storage, self.dht.protocol.cache):
            with contextlib.suppress(Exception):
                del store[key_id]

    async def publish_spec(self) -> None:
        """Store (again) the spec this peer runs under its own key, signed; every peer does, every
        SPEC_TTL_S / 3, so the spec lives as long as any peer does."""
        self._spec_stored = time.monotonic()
        await publish_spec(self.dht, self.me, self.spec, self.swarm_key)

    # -- services and compute ----------------------------------------------------------

    def gossip(self, codec: PayloadCodec) -> Gossip:
        """The exchange service of this run over ``codec`` (not yet served)."""
        cfg = self.spec.network
        g = Gossip(
            self.p2p,
            self.rpc,
            run_id=self.run_id,
            me=self.me,
            codec=codec,
            limits=self.limits,
            faults=self.faults,
            max_body_bytes=int(cfg.max_message_mb * 2**20),
            streams=cfg.streams_per_transfer,
            parallel_threshold=int(cfg.parallel_threshold_mb * 2**20),
            max_wait_s=cfg.max_wait_s,
        )
        g.stats.paths.sink = self.events.write  # an "exchange" event per payload (transport/paths.py)
        return g

    @property
    def trusted(self) -> frozenset[str]:
        """The peer ids of the user's ``--initial-peers``: preferred as state donors (``state_donors(prefer=)``)."""
        return frozenset(peer_ids_of(self.opts.initial_peers))

    async def fetch_state(
        self, donors: list[str], expected: Mapping[str, tuple[int, ...]], judge: Judge | None = None
    ) -> Synced | None:
        """A state of ``expected``'s layout (the driver's own model) that a minority of lying ``donors`` cannot
        steer (``transport/state_sync.py``), or None: the driver starts from its own weights. Liars are faults;
        ``judge`` is the driver's check of each candidate state before it counts."""
        return await fetch_state(
            self.p2p,
            run_id=self.run_id,
            me=self.me,
            donors=donors,
            limits=self.limits,
            expected=expected,
            on_fault=self.faults.record,
            judge=judge,
        )

    async def serve(self, *services: Service) -> None:
        for s in services:
            await self.rpc.add(s)

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the compute thread (the loop never blocks on a forward pass)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def default_shard(self) -> tuple[int, int]:
        return self.opts.shard or (int(self.me.encode().hex()[-8:], 16) % 64, 64)

    def stream_key(self) -> int:
        """Keys this peer's data generator: the shard index where one was given, else 64 bits of its peer id
        (under data.sharding = iid every peer samples the whole split, and no two draw the same windows)."""
        return self.opts.shard[0] if self.opts.shard else int(self.me.encode().hex()[-16:], 16)

    def _banned(self, peer: str, for_s: float, faults: int) -> None:
        """Each ban goes to the event log: the peer, for how long, after how many faults (a ban ends by itself)."""
        self.events.write("banned", banned_peer=peer, for_s=round(for_s, 1), faults=faults)

    def note_screening(self, round_idx: int | None, outcome: Screened) -> None:
        """A rejected outer update is a fault against its sender (the round went on without it). Every applied
        round's screening goes to the event log: whose updates were screened, rejected, clipped, and DiLoCo's
        fallback."""
        for sender, why in outcome.rejected:
            self.faults.record(str(sender), f"round {round_idx}: update rejected: {why}")
        if round_idx is not None:
            self.events.write(
                "screened",
                round=round_idx,
                senders=[str(p) for p in outcome.senders],
                rejected=[str(p) for p, _ in outcome.rejected],
                clipped={str(p): scale for p, scale in outcome.clipped},
                fallback=outcome.fallback,
            )

    def device_and_plan(self) -> tuple[Any, Any]:
        """The device and the memory plan of ``--max-memory`` (``train/plan.py``), logged as a ``plan`` event.
        Call it in the compute thread before the model is on the device (the device's free memory is the
        default budget)."""
        from locomm.train import peer_plan, resolve_device  # noqa: PLC0415 - imports torch

        device = resolve_device(self.opts.device)
        plan = peer_plan(self.spec, device=device, max_memory_gb=self.opts.max_memory_gb)
        if plan is None:
            return device, None
        self.events.write("plan", **plan.as_json())
        log.info("memory plan:\n%s", plan.describe())
        return device, plan

    def up(self, **fields: Any) -> None:
        """The driver is ready: heartbeats start, our addresses go where `locomm-peer swarm` (or a test) waits
        for them, and the ``started`` event is written with the driver's ``fields``."""
        self.start_heartbeats()
        maddrs = [str(m) for m in self.maddrs]
        if self.opts.announce_file:
            atomic_write_text(self.opts.announce_file, "\n".join(maddrs) + "\n")
        self.events.write("started", peer=self.me, maddrs=maddrs, run=self.run_id, algo=self.spec.outer.algo, **fields)
        log.info("peer %s up; others join with --initial-peers %s", self.me, maddrs[0] if maddrs else "?")

    # -- heartbeats --------------------------------------------------------------------

    async def read_beats(self) -> list[Heartbeat]:
        """The run's heartbeats (each verified by the validator); a peer's round never moves backwards: an
        older record of a peer than the newest seen (a replay) is replaced by that newest one. Each one's
        ``time`` is then on our clock (``membership.observed_time``): what reads it judges freshness by what we
        saw, whatever the writer's clock says."""
        read = await read_heartbeats(self.dht, self.run_id)
        now = dht_clock.now()  # after the read: a record stored while it ran is not placed in our future
        beats = []
        for b in read:
            prev = self._newest.get(b.peer)
            if prev is not None and not newer(b, prev):
                if prev.expires < now:
                    continue
                b = prev
            if b.finished and (prev is None or not prev.finished):
                log.info("peer %s left (its goodbye: round %d)", b.peer[-8:], b.round)
            self._newest[b.peer] = b
            seen = observed_time(b.time, now, self._heard.get(b.peer))
            self._heard[b.peer] = (b.time, seen, now)
            beats.append(b if seen == b.time else replace(b, time=seen))
        if len(self._newest) > 4 * len(beats) + 64:
            self._newest = {p: b for p, b in self._newest.items() if b.expires >= now}
            self._pace = {p: v for p, v in self._pace.items() if p in self._newest}
            self._heard = {p: v for p, v in self._heard.items() if p in self._newest}
        t = time.monotonic()
        for b in beats:
            pace = self._pace.get(b.peer)
            if pace is None or b.round < pace[0]:  # first seen, or back behind where we first saw it: anew
                self._pace[b.peer] = (b.round, t, b.round, t)
            elif b.round > pace[2]:
                self._pace[b.peer] = (pace[0], pace[1], b.round, t)
        self.records = {b.peer: b for b in beats}
        self.sightings.keep(self.records, t)
        await self._sight(b.peer for b in beats)
        return self._counted()

    def _counted(self) -> list[Heartbeat]:
        """The records of peers seen alive (and ours) become ``beats``: what every driver counts."""
        now = time.monotonic()
        self.beats = {p: b for p, b in self.records.items() if p == self.me or self.sightings.alive(p, now)}
        return list(self.beats.values())

    def _sighted(self, peer: str) -> None:
        """A stream from ``peer`` (a hello, or any other service's): it is alive. Only identities whose heartbeat
        we hold are noted (identities are cheap to make; the records are what the validator lets in): for
        another, a heartbeat read soon, whose own hello to it will note it."""
        if peer not in self.records:
            if self._tg is not None:
                self.refresh_soon()
            return
        self.sightings.saw(peer, time.monotonic(), self._round_now)
        if peer not in self.beats:
            self._counted()

    async def _sight(self, peers: Any) -> None:
        """Say hello to the identities due (never seen alive, a sighting growing old, a backoff over); until we
        are a started member, wait ``SIGHT_WAIT_S`` at most for the answers of those asked for the first time.
        Answers land when they come."""
        if self._tg is None:  # the host is stopping: its last reads ask nobody
            return
        now = time.monotonic()
        due = [p for p in peers if p != self.me and self.sightings.due(p, now)]
        first = [p not in self.sightings for p in due]
        for p in due:
            self.sightings.asking(p, now, hello.ASK_TIMEOUT_S)
        asks = [self.spawn(self._hello(p), background=True) for p in due]
        waited = [a for a, new in zip(asks, first, strict=True) if new]  # a dead peer's record costs one wait
        if waited and self._round_now is None:
            await asyncio.wait(waited, timeout=SIGHT_WAIT_S)

    async def _hello(self, peer: str) -> None:
        if await hello.ask(self.p2p, self.run_id, peer):
            self.sightings.saw(peer, time.monotonic(), self._round_now)
            self._counted()  # counted from now, not from the next read
        else:
            self.sightings.missed(peer, time.monotonic())

    async def netgroups(self) -> dict[str, str]:
        """Per connected peer, its ``membership.netgroup`` as p2pd's live connections show it (donors of many
        groups: identities minted behind one address fill one slot)."""
        return {peer: netgroup(addrs) for peer, addrs in (await live_connections(self.p2p)).items()}

    def since(self) -> dict[str, int]:
        """Per peer seen alive, our round when we first saw it: no peer is admitted before (``members_for_round``)."""
        return self.sightings.since()

    async def ages(self) -> dict[str, int]:
        """Per peer, the earliest round that we or one of the user's ``--initial-peers`` first saw it alive in
        (``hello.ask_seen``; each asked once, in parallel, ``hello.ASK_TIMEOUT_S`` at most): a state donor's
        observed age. A joiner's own sightings are seconds old; its trusted peers' may be hours old."""
        out = self.sightings.ages()
        asks = [p for p in self.trusted if p != self.me and p in self.beats]  # seen alive: a dead one costs no wait
        for view in await asyncio.gather(*(self._ask_seen(p) for p in asks)):
            for peer, first in (view or {}).items():
                out[peer] = min(first, out.get(peer, first))
        return out

    async def _ask_seen(self, peer: str) -> dict[str, int] | None:
        """``hello.ask_seen``, once more a second later if refused: a joiner that has just stored its heartbeat
        is not yet among the records a peer read (``recheck`` reads again at most every 0.5 s)."""
        view = await hello.ask_seen(self.p2p, self.run_id, peer)
        if view is None:
            await self.sleep(1.0)
            view = await hello.ask_seen(self.p2p, self.run_id, peer)
        return view

    def observed_round_s(self, peer: str) -> float | None:
        """A peer's seconds per round as we saw its round counter move (None before it moved twice): the
        bound on what it may declare of its pace (``protocol/timing.partner_eta``)."""
        pace = self._pace.get(peer)
        if pace is None or pace[2] - pace[0] < 2:
            return None
        return (pace[3] - pace[1]) / (pace[2] - pace[0])

    async def publish(self, beat: Heartbeat | None = None) -> None:
        """Store our heartbeat now (the driver's current one unless given)."""
        beat = beat if beat is not None else self.heartbeat() if self.heartbeat is not None else None
        if beat is None:
            return
        # The record outlives the membership lag (MEMBER_LAG_ROUNDS rounds), so a peer that died drops out of
        # every peer's member list by its frozen round counter, at the same round, not by a clock.
        self._round_now = beat.round if beat.started and beat.admitted else None
        ttl = heartbeat_ttl(beat.round_s, self.spec.network.heartbeat_ttl_s)
        # Never expiring before our last record, which DHT nodes would keep instead (they keep the later-expiring
        # value): a goodbye whose TTL had shrunk with the round time (7 x round_s) was refused, and partners waited
        # for the leaver to a deadline for 3 rounds. A refusal all the same means a longer-lived record of ours
        # is there (an earlier process of this identity): read when it expires, and store once more past it.
        # A goodbye must reach a node other than ourselves, and is tried again until one takes it: stored on
        # ourselves alone (the others did not answer in time), it went with us, they kept our last live record,
        # and partners planned rounds with us until it expired (a flaky test_long_lived under load).
        until = self._stored_until + 1e-3
        if beat.finished and not await self._store_elsewhere(beat, ttl, until):
            log.info("no other DHT node took our goodbye (round %d): our last heartbeat expires instead", beat.round)
        for attempt in range(2):
            if await store_heartbeat(self.dht, self.run_id, self.me, beat.record(), ttl, not_before=until):
                self._stored_until = max(until, dht_clock.now() + ttl + MAX_CLOCK_SKEW_S)
                return
            if attempt == 0:
                until = max(until, await stored_expiration(self.dht, self.run_id, self.me) + 1e-3)
        log.warning("our heartbeat (round %d) was not stored; the next one is tried as usual", beat.round)

    async def _store_elsewhere(self, beat: Heartbeat, ttl: float, until: float) -> bool:
        """``beat`` on other DHT nodes than ours: up to GOODBYE_ATTEMPTS stores within GOODBYE_S (the third and
        fourth 1 s apart, none after a second signal). False: no other node took it (the last peer of a swarm
        has nobody to tell)."""
        record = beat.record()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(GOODBYE_S):
                for attempt in range(GOODBYE_ATTEMPTS):
                    if attempt >= 2:
                        if self.hurry.is_set():
                            break
                        await self.sleep(1.0)
                    if await store_heartbeat(self.dht, self.run_id, self.me, record, ttl, until, elsewhere=True):
                        return True
        return False

    async def _remember_peers(self) -> None:
        """The peers we read, for a restart to bootstrap through (peer/transport/peer_cache.py): when we read one
        the file does not name yet, else once a minute; a folder we cannot write (a full disk) keeps the old
        list."""
        folder = self.opts.checkpoint_dir
        if folder is None:
            return
        beats = list(self.beats.values())
        peers = peer_cache.candidates(beats, self.me)
        due = time.monotonic() - self._remembered >= peer_cache.REMEMBER_EVERY_S
        if not due and peers <= self._remembered_peers:
            return
        self._remembered, self._remembered_peers = time.monotonic(), peers
        with contextlib.suppress(OSError):
            await asyncio.to_thread(peer_cache.remember, folder, beats, self.me)

    def publish_soon(self) -> None:
        """Store our heartbeat in the background (fresh round numbers keep joiners' choices right)."""
        self.spawn(self.publish(), background=True)

    def start_heartbeats(self) -> None:
        self.spawn(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        while not self.stop.is_set():
            try:
                await self.read_beats()
                await self.publish()
                await self._remember_peers()
                if time.monotonic() - self._spec_stored > SPEC_TTL_S / 3:
                    await self.publish_spec()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a missed heartbeat is not fatal
                log.warning("heartbeat failed: %s", e)
            await self.sleep(self.spec.network.heartbeat_interval_s)

    async def wait_for(self, ready: Callable[[list[Heartbeat]], bool], timeout: float, what: str) -> None:
        """Read the heartbeats until ``ready(beats)`` (or ``timeout``, then start anyway, saying so)."""
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            if ready(await self.read_beats()):
                return
            if time.monotonic() > deadline:
                log.warning("no %s after %.0f s; starting anyway", what, timeout)
                return
            await asyncio.sleep(0.25)

    async def settle_view(self, reads: int = 10) -> None:
        """A joiner's first DHT reads can return part of the swarm (its routing table is still filling):
        read until two reads in a row see the same peers, so its first groups are everyone's groups."""
        seen: set[str] = set()
        for _ in range(reads):
            now = {b.peer for b in await self.read_beats()}
            if now == seen:
                return
            seen = now
            await asyncio.sleep(0.5)

    async def sleep(self, seconds: float) -> None:
        """Sleep, waking early when the host is stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    async def recheck(self, ok: Callable[[], bool]) -> bool:
        """``ok()`` now, else after one fresh DHT read (shared, at most one per 0.5 s: a flood costs one read)."""
        if ok():
            return True
        self.refresh_soon(0.5)
        with contextlib.suppress(Exception):
            await asyncio.shield(self._refresh)
        return ok()

    def refresh_soon(self, min_gap_s: float = 1.0) -> None:
        """Read the heartbeats again in the background, unless a read is running or began in the last
        ``min_gap_s`` (shared by every caller: a flood of them costs one read)."""
        if self._refresh is None or (self._refresh.done() and time.monotonic() - self._unknown_read > min_gap_s):
            self._unknown_read = time.monotonic()
            self._refresh = self.spawn(self.read_beats(), background=True)

    async def authorize(self, remote: str, policy: str) -> bool:
        """The services' authorize hook: members for gossip, any announced peer for state sync and stages. The
        stream itself shows ``remote`` alive (libp2p checked its key)."""
        if not await self.recheck(lambda: remote in self.records):
            return False
        self._sighted(remote)
        return remote in self.beats and (policy == "announced" or self.beats[remote].admitted)

    def dht_now(self) -> float:
        """The swarm's time as this peer keeps it (``peer/transport/dht_clock.py``): what heartbeats' times are on."""
        return dht_clock.now()

    # -- the user's view ---------------------------------------------------------------

    def start_reporter(self, status: Callable[[], dict[str, Any]]) -> None:
        if self.opts.reporter is not None:
            self.spawn(self._report_loop(status))

    async def _report_loop(self, status: Callable[[], dict[str, Any]]) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                self.opts.reporter.update(status())
            await self.sleep(0.5)

    def report(self, method: str, arg: dict[str, Any]) -> None:
        """``reporter.round_done(...)`` / ``finish(...)``; a display error never stops the node."""
        if self.opts.reporter is not None:
            with contextlib.suppress(Exception):
                getattr(self.opts.reporter, method)(arg)


def lower_priority(by: int = COMPUTE_NICE) -> None:
    """Raise the calling thread's nice value by ``by`` (capped at 19); Linux only (elsewhere setpriority's "process"
    is the whole process), and a refusal is logged, not raised."""
    if not sys.platform.startswith("linux") or by <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError as e:
        log.debug("could not lower the compute thread's priority: %s", e)


def dump_tasks() -> None:
    """Log (WARNING, so a quiet peer shows it too) the stack of every asyncio task and thread: what a peer that
    seems stuck is waiting for (SIGUSR1; the local swarm launcher sends it before stopping a run that hangs)."""
    import io  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    out = io.StringIO()
    for ident, frame in sys._current_frames().items():  # noqa: SLF001 - the thread stacks, as faulthandler gives
        out.write(f"--- thread {ident}\n{''.join(traceback.format_stack(frame, limit=12))}")
    for task in asyncio.all_tasks():  # last: a log's tail shows where the event loop's tasks wait
        out.write(f"--- task {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(limit=12, file=out)
    log.warning("SIGUSR1: every task and thread now\n%s", out.getvalue())


async def _logged(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.warning("background task failed: %s: %s", type(e).__name__, e)
        return None

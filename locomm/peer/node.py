"""The peer daemon: one asyncio loop running hivemind's P2P and DHTNode, compute in one worker thread.

Lifecycle of ``Node.run()``:
1. start p2pd (``P2P.create``) and a ``DHTNode`` inside this loop (not the forking
   ``hivemind.DHT``);
2. settle the run spec: the first peer publishes it, a joiner fetches it and
   refuses a different hash or protocol version;
3. build the trainer and outer algorithm in the worker thread; resume from the
   own checkpoint, or download state from live peers when joining a running swarm;
4. train: H inner steps per round in the worker thread, then the round's exchange
   over P2P streams. With ``overlap`` the exchange runs while the next round's
   inner steps compute, and its result is applied at the end of that next round,
   exactly one round late whenever it arrived, keeping the local progress made
   meanwhile (theta <- phi_new + (theta_now - theta_sent));
5. on SIGINT/SIGTERM or the last round: finish the pending exchange, checkpoint
   atomically, shut P2P and the DHT down.

Everything that touches the model (steps, plan, apply, snapshots) runs in the
single worker thread, so no two of them ever race.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind.dht import DHTNode
from hivemind.p2p import P2P

from locomm import PROTOCOL_VERSION, __version__
from locomm.compression.payload import PayloadCodec
from locomm.config import ConfigError, RunSpec
from locomm.peer.gossip import Faults, Gossip
from locomm.peer.metrics import EventLog, Metrics
from locomm.peer.rpc import Limits, RpcServer
from locomm.peer.state import Snapshot, StateServer, fetch_state
from locomm.peer.swarm import (
    MEMBER_LAG_ROUNDS,
    Heartbeat,
    fetch_spec,
    members_for_round,
    publish_spec,
    read_heartbeats,
    store_heartbeat,
)
from locomm.protocol import build_outer

log = logging.getLogger(__name__)
JOIN_MARGIN_ROUNDS = 2
STATE_ATTEMPTS = 3
"""Whole state downloads a joiner tries before it starts from the initial weights."""
NOT_ADMITTED = 2**31 - 1
"""join_round of a joiner that has not synced yet: nobody counts it as a member."""


class SpecMismatch(ConfigError):
    """The swarm runs a different spec or protocol version than this peer was given."""


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    """Local settings of one node (never part of the shared run spec)."""

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity: Path | None = None
    device: str = "auto"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 5
    """Rounds between checkpoints (and one at shutdown)."""
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds (0.0.0.0: every interface, e.g. in a container)."""
    log_file: Path | None = None
    rounds: int | None = None
    """Stop after this many rounds (default: the rounds spec.train.steps allows)."""
    wait_for_peers: int = 0
    """Before the first round, wait (up to a minute) until this many peers, self included, are admitted."""
    until_round: int | None = None
    """Stop when the swarm's round counter reaches this (all peers of a local swarm end together)."""
    shard: tuple[int, int] | None = None
    """(index, count) of this node's data shard; default: derived from the peer id."""
    overlap: bool = True
    announce_file: Path | None = None
    """Write this node's multiaddrs here once it is up (used by `locomm-peer swarm`)."""
    final_weights: Path | None = None
    """Write the final outer weights here (safetensors) on a clean finish."""
    spec_from_user: bool = True
    """False when the spec is only a default: a joiner then takes the swarm's without comparing."""
    reporter: Any = None
    """Shows the user what the node is doing (locomm.cli.display.JoinReporter): ``update(status)``
    about twice a second, ``round_done(status)`` after each round, ``finish(summary)`` at exit."""


class Node:
    def __init__(self, spec: RunSpec, opts: NodeOptions) -> None:
        if spec.outer.algo not in ("noloco", "gasloc", "sparseloco", "diloco"):
            raise ConfigError(
                f"outer.algo: the peer daemon runs noloco, gasloc, sparseloco or diloco; "
                f"{spec.outer.algo!r} is a simulator baseline (locomm-peer simulate)"
            )
        self.spec = spec
        self.opts = opts
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="locomm-compute")
        self.codec_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="locomm-codec")
        self.reporter = opts.reporter
        self.beats: dict[str, Heartbeat] = {}
        self._beats_read = 0.0
        self._unknown_read = 0.0
        self._refresh: asyncio.Future | None = None
        self.round_t0 = time.time()
        self.round_s = 0.0
        self.phase = "starting"
        self.end_round: int | None = None
        self.members = 0
        self.partners = 0
        self.t_train = time.perf_counter()
        self.avg_bytes = 0
        self.stop = asyncio.Event()
        self.events = EventLog(opts.log_file)
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.averager: Any = None
        self.round = 0
        self.join_round = 0
        self.last_loss = float("nan")
        self.val_loss = float("nan")
        self.tokens_per_s = 0.0
        self.wait_s = 0.0
        self.started = False
        self.last_answered = 0
        self.summary: dict[str, Any] = {}

    # -- helpers -----------------------------------------------------------------------

    async def compute(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` in the compute thread (the loop never blocks on a forward pass)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.trainer.model.named_parameters())

    # -- start-up ----------------------------------------------------------------------

    async def _settle_spec(self) -> None:
        assert self.dht is not None
        if not self.opts.initial_peers:
            await publish_spec(self.dht, self.spec.hash(), self.spec.to_toml())
            return
        remote = None
        for _ in range(20):
            remote = await fetch_spec(self.dht)
            if remote is not None:
                break
            await asyncio.sleep(0.5)
        if remote is None:
            raise SpecMismatch("no run spec found in the swarm (is --initial-peers right?)")
        if remote["version"] != PROTOCOL_VERSION:
            raise SpecMismatch(
                f"the swarm speaks protocol {remote['version']}, this peer {PROTOCOL_VERSION}; upgrade locomm"
            )
        if self.opts.spec_from_user and remote["hash"] != self.spec.hash():
            raise SpecMismatch(
                f"the swarm's run spec {remote['hash'][:12]} differs from yours "
                f"{self.spec.hash()[:12]}; join without --config to take the swarm's"
            )
        spec = RunSpec.from_toml(remote["toml"])
        if spec.hash() != remote["hash"]:
            raise SpecMismatch("the swarm's published spec does not match its own hash")
        self.spec = spec

    def _build(self, shard: tuple[int, int]) -> None:
        from locomm.train import Trainer, resolve_device  # noqa: PLC0415

        self.trainer = Trainer(
            self.spec, device=resolve_device(self.opts.device), worker_id=shard[0], num_workers=shard[1]
        )
        self.algo = build_outer(self.spec.outer, self.params(), self.me)

    def _payload_codec(self) -> PayloadCodec:
        """The one role-aware codec of this run's payloads (the simulator builds the same one)."""
        return PayloadCodec(
            {k: tuple(p.shape) for k, p in self.params().items()},
            self.algo.payload_roles,
            self.spec.compression,
            encoded=self.algo.payload_encoded,
        )

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {
            **{f"model/{k}": v for k, v in self.algo.phi.items()},
            **{f"outer/{k}": v for k, v in self.algo.state_dict().items()},
        }

    def _load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        model = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
        outer = {k[len("outer/") :]: v for k, v in tensors.items() if k.startswith("outer/")}
        with torch.no_grad():
            for k, p in self.params().items():
                p.copy_(model[k])
        self.algo.load_state_dict(outer)

    def _resume(self) -> bool:
        if self.opts.checkpoint_dir is None:
            return False
        ckpt = self.trainer.try_resume(self.opts.checkpoint_dir)
        if ckpt is None:
            return False
        self.algo.load_state_dict(ckpt.aux)
        self.round = int(ckpt.extra.get("round", 0))
        return True

    def _checkpoint(self) -> None:
        if self.opts.checkpoint_dir is not None:
            self.trainer.save(self.opts.checkpoint_dir, aux=self.algo.state_dict(), extra={"round": self.round})

    async def _enter_swarm(self, resumed: bool) -> None:
        """Pick the round to join at; download state from live peers unless we resumed our own."""
        assert self.dht is not None and self.p2p is not None
        beats = [b for b in await read_heartbeats(self.dht, self.run_id) if b.peer != self.me]
        top = max((b.round for b in beats), default=0)
        if all(not b.fields.get("started") for b in beats) and top == 0:
            self.join_round = self.round  # nobody has trained yet: start together
            return
        # Join a little ahead of the swarm, so every peer counts us from the same round on: peers
        # that computed a round's membership before our heartbeat reached them never expect us in it.
        self.join_round = max(top + JOIN_MARGIN_ROUNDS, self.round)
        await self._heartbeat()
        if not resumed and top > 0:
            donors = [b.peer for b in sorted(beats, key=lambda b: -b.round)[:3]]
            max_bytes = int(self.spec.network.max_message_mb * 2**20) * 4
            self.phase = "syncing"
            got = None
            for attempt in range(STATE_ATTEMPTS):  # the state moved on twice while we fetched: ask again
                got = await fetch_state(
                    self.p2p,
                    run_id=self.run_id,
                    me=self.me,
                    donors=donors,
                    limits=self.limits,
                    max_bytes=max_bytes,
                    on_fault=self.faults.record,
                )
                if got is not None or self.stop.is_set():
                    break
                log.info("state download %d/%d failed; asking the donors again", attempt + 1, STATE_ATTEMPTS)
            if got is None:
                log.warning("could not download state from %d donors; starting from the initial weights", len(donors))
                self.events.write("sync_failed", donors=len(donors))
            else:
                donor_round, tensors = got
                await self.compute(self._load_state, tensors)
                self.events.write("synced", donor_round=donor_round, tensors=len(tensors))
                log.info("synced state of round %d from %d donor(s)", donor_round, len(donors))
        self.round = self.join_round
        self.trainer.step = self.round * self.spec.outer.inner_steps
        # A joiner's first DHT reads can return part of the swarm (its routing table is still filling):
        # read until two reads in a row see the same peers, so its first groups are everyone's groups.
        seen: set[str] = set()
        for _ in range(10):
            now = {b.peer for b in await self._read_beats()}
            if now == seen:
                break
            seen = now
            await asyncio.sleep(0.5)

    async def _wait_for_peers(self, n: int, timeout: float = 60.0) -> None:
        assert self.dht is not None
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            beats = await read_heartbeats(self.dht, self.run_id)
            admitted = {b.peer for b in beats if b.join_round <= self.round} | {self.me}
            if len(admitted) >= n:
                return
            if time.monotonic() > deadline:
                log.warning("only %d of %d peers after %.0f s; starting anyway", len(admitted), n, timeout)
                return
            await asyncio.sleep(0.25)

    # -- heartbeats --------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        assert self.dht is not None and self.p2p is not None
        record = {
            "round": self.round,
            "join_round": self.join_round,
            "step": self.trainer.step,
            "started": self.started,
            "loss": _finite(self.last_loss),
            "val_loss": _finite(self.val_loss),
            "tokens_per_s": self.tokens_per_s,
            "bytes_sent": self._bytes_sent(),
            "last_exchange": self.gossip.stats.last_exchange,
            "version": __version__,
            "maddrs": [str(m) for m in self.maddrs],
            "avg_maddrs": self.averager.maddrs() if self.averager is not None else [],
            # What partners need for an ETA of our payload: when this round's compute began, how long
            # a round takes us, how fast we upload, to how many partners.
            "round_t0": self.round_t0,
            "round_s": self.round_s,
            "up_Bps": self.gossip.stats.up_Bps,
            "partners": self.partners,
            "faults": self.faults.total,
            "banned": len(self.faults.banned),
        }
        # The record outlives the membership lag (MEMBER_LAG_ROUNDS rounds), so a peer that died drops out of
        # every peer's member list by its frozen round counter, at the same round, not by a clock.
        ttl = max(self.spec.network.heartbeat_ttl_s, (MEMBER_LAG_ROUNDS + 2) * self.round_s)
        await store_heartbeat(self.dht, self.run_id, self.me, record, ttl)

    async def _read_beats(self) -> list[Heartbeat]:
        assert self.dht is not None
        beats = await read_heartbeats(self.dht, self.run_id)
        self.beats = {b.peer: b for b in beats}
        self._beats_read = time.monotonic()
        return beats

    async def _authorize(self, remote: str, policy: str) -> bool:
        """The services' authorize hook: members for gossip, any announced peer for state sync."""
        beat = self.beats.get(remote)
        if beat is None:  # a peer we have not seen yet: one DHT read, shared by its concurrent streams
            if self._refresh is None or (self._refresh.done() and time.monotonic() - self._unknown_read > 0.5):
                self._unknown_read = time.monotonic()
                self._refresh = asyncio.ensure_future(self._read_beats())
            with contextlib.suppress(Exception):
                await asyncio.shield(self._refresh)
            beat = self.beats.get(remote)
        if beat is None:
            return False
        return policy == "announced" or beat.join_round < NOT_ADMITTED

    def _eta(self, round_idx: int) -> Any:
        """Monotonic time by which a partner's payload of ``round_idx`` should be here (from its heartbeat)."""
        net = self.spec.network
        wire = max(1, self.codec.raw_bytes())

        def eta(peer: str) -> float:
            now_wall, now = time.time(), time.monotonic()
            b = self.beats.get(peer)
            own = max(self.round_s, 1.0)
            f = b.fields if b is not None else {}
            round_s = float(f.get("round_s") or own)
            t0 = float(f.get("round_t0") or now_wall)
            up = float(f.get("up_Bps") or 0.0) or net.min_rate_mbit * 1e6 / 8
            partners = max(1, int(f.get("partners") or 1))
            rounds_to_go = round_idx - b.round + 1 if b is not None else 1  # <= 0: it has sent already
            ready = now_wall if rounds_to_go <= 0 else t0 + rounds_to_go * round_s
            arrive = max(ready, now_wall) + wire * partners / up
            # Slack: a stall timeout, and a quarter of a round for jitter in the partner's compute.
            return now + (arrive - now_wall) + net.stall_timeout_s + 0.25 * round_s

        return eta

    def _bytes_sent(self) -> int:
        return self.gossip.stats.bytes_sent + self.avg_bytes

    def _bytes_received(self) -> int:
        return self.gossip.stats.bytes_received + self.avg_bytes

    def status(self) -> dict[str, Any]:
        """What the node is doing now, for the live display (locomm.cli.display); called once the node's
        trainer and services exist (the report loop and round_done start after them)."""
        return {
            "peer": self.me[-8:],
            "round": self.round,
            "end_round": self.end_round,
            "step": self.trainer.step,
            "loss": _finite(self.last_loss),
            "val_loss": _finite(self.val_loss),
            "tokens_per_s": self.tokens_per_s,
            "members": self.members,
            "partners": self.partners,
            "answered": self.last_answered,
            "bytes_sent": self._bytes_sent(),
            "bytes_received": self._bytes_received(),
            "wait_s": self.wait_s,
            "wall_s": time.perf_counter() - self.t_train,
            "phase": self.phase,
            "transfers": [m.view() for m in list(self.rpc.meters)],
            "faults": self.faults.total,
            "banned": len(self.faults.banned),
        }

    async def _report_loop(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                self.reporter.update(self.status())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.5)

    async def _heartbeat_loop(self) -> None:
        while not self.stop.is_set():
            try:
                await self._read_beats()
                await self._heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is not fatal
                log.warning("heartbeat failed: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.spec.network.heartbeat_interval_s)

    # -- rounds ------------------------------------------------------------------------

    def _plan(self, round_idx: int, members: list[str]) -> tuple[Any, dict[str, torch.Tensor]]:
        sent = {k: p.detach().clone() for k, p in self.params().items()}
        return self.algo.plan(round_idx, members, self.params()), sent

    def _apply(self, round_idx: int, sent: dict[str, torch.Tensor], inputs: dict[str, Any]) -> None:
        """Outer update for the state we sent; local progress made since then is kept on top."""
        target = {k: v.clone() for k, v in sent.items()}
        self.algo.apply(round_idx, target, inputs)
        with torch.no_grad():
            for k, p in self.params().items():
                p.add_(target[k] - sent[k])
        self.state_server.snapshot = Snapshot.take(round_idx, self._state_tensors())

    async def _exchange(self, round_idx: int, plan: Any) -> tuple[dict[str, Any], int]:
        """Everything the outer rule needs (our own payload included), and how many partners answered."""
        if self.averager is not None:  # DiLoCo: hivemind's all-reduce gives the group mean directly
            out = await self.averager.exchange(plan.payload)
            if out is None:
                self.gossip.stats.exchanges_failed += 1
                return {self.me: plan.payload}, 0
            mean, group = out
            # hivemind keeps no byte counters: a butterfly all-reduce over N peers sends (and receives)
            # (N-1)/N of the payload twice (scatter-reduce, then all-gather of the averaged parts).
            nbytes = sum(v.numel() * v.element_size() for v in plan.payload.values())
            self.avg_bytes += int(2 * nbytes * (group - 1) / max(1, group))
            self.gossip.stats.exchanges_ok += group - 1
            return {"group-mean": mean}, group - 1
        got = await self.gossip.exchange(round_idx, plan.peers, plan.payload, eta=self._eta(round_idx))
        return {self.me: plan.payload, **got}, len(got)

    async def _finish(self, pending: tuple[int, Any, dict, asyncio.Task] | None) -> int:
        """Wait for an in-flight exchange and apply it; returns how many partners answered."""
        if pending is None:
            return 0
        r, plan, sent, task = pending
        t0 = time.perf_counter()
        if self.stop.is_set():  # shutting down: give the exchange a few seconds, not a full timeout
            self.phase = "stopping"
            done, _ = await asyncio.wait({task}, timeout=5.0)
            if not done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return 0
        if not task.done():
            self.phase = "exchanging"
        inputs, answered = await task
        self.wait_s += time.perf_counter() - t0
        self.phase = "training"
        await self.compute(self._apply, r, sent, inputs)
        self.last_answered = answered
        return answered

    async def _train(self, end_round: int) -> None:
        assert self.dht is not None
        H = self.spec.outer.inner_steps
        eval_rounds = max(1, self.spec.train.eval_interval // H) if self.spec.train.eval_interval else 0
        pending: tuple[int, Any, dict, asyncio.Task] | None = None
        t_start = time.perf_counter()
        self.end_round = end_round
        self.phase = "training"
        self.t_train = time.perf_counter()
        while self.round < end_round and not self.stop.is_set():
            self.gossip.advance(self.round)
            t0 = time.perf_counter()
            self.round_t0 = time.time()
            losses = []
            # The previous round's exchange runs meanwhile; it is applied at this round's end, exactly one
            # round late whenever it finished, so the numerics do not depend on the network's speed (and
            # match the simulator's schedule) as long as an exchange takes no longer than a round.
            apply_at = self.spec.outer.apply_delay_steps or H
            for i in range(H):
                if pending is not None and i == apply_at:
                    await self._finish(pending)
                    pending = None
                losses.append(await self.compute(self.trainer.train_step))
                if self.stop.is_set():
                    break
            self.last_loss = sum(losses) / len(losses)
            compute_s = time.perf_counter() - t0
            self.tokens_per_s = len(losses) * self.trainer.tokens_per_step / compute_s
            self.round_s = compute_s if self.round_s == 0 else 0.7 * self.round_s + 0.3 * compute_s
            await self._finish(pending)
            pending = None
            if self.stop.is_set():  # stopping: no new exchange; the last partial round stays local
                break
            # Bans are not applied here: every peer must derive the same groups; a banned or unreachable
            # partner is skipped at exchange time instead.
            members = members_for_round(
                await self._read_beats(), self.round, self.me, fresh_s=self.spec.network.heartbeat_ttl_s
            )
            plan, sent = await self.compute(self._plan, self.round, members)
            self.members, self.partners = len(members), len(plan.peers)
            task = asyncio.create_task(self._exchange(self.round, plan))
            pending = (self.round, plan, sent, task)
            if not self.opts.overlap:
                await self._finish(pending)
                pending = None
            self.round += 1
            if eval_rounds and self.round % eval_rounds == 0:
                self.val_loss = await self.compute(self.trainer.evaluate)
            wall = time.perf_counter() - t_start
            self.metrics.set(
                round=self.round,
                step=self.trainer.step,
                loss=self.last_loss,
                tokens_per_s=self.tokens_per_s,
                members=len(members),
                bytes_sent=self._bytes_sent(),
                bytes_received=self._bytes_received(),
                wait_s=self.wait_s,
            )
            self.events.write(
                "round",
                round=self.round,
                step=self.trainer.step,
                loss=self.last_loss,
                val_loss=_finite(self.val_loss),
                members=len(members),
                peers=len(plan.peers),
                partners=sorted(plan.peers),
                member_ids=members,
                answered=self.last_answered,
                bytes_sent=self._bytes_sent(),
                bytes_received=self._bytes_received(),
                wait_s=self.wait_s,
                wall_s=wall,
                compute_s=compute_s,
                tokens_per_s=self.tokens_per_s,
                faults=self.faults.total,
            )
            if self.reporter is not None:
                with contextlib.suppress(Exception):
                    self.reporter.round_done(self.status())
            if self.opts.checkpoint_every and self.round % self.opts.checkpoint_every == 0:
                await self.compute(self._checkpoint)
            hb = asyncio.create_task(self._heartbeat())  # fresh round numbers keep joiners' choices right
            hb.add_done_callback(lambda t: t.cancelled() or t.exception())
        await self._finish(pending)

    # -- main --------------------------------------------------------------------------

    def _make_services(self) -> None:
        """The RPC server, gossip over ``self.codec`` and the state server (not yet added to the server)."""
        cfg = self.spec.network
        self.rpc = RpcServer(
            self.p2p,
            self.run_id,
            self.limits,
            self.codec_pool,
            authorize=self._authorize,
            is_banned=lambda peer: peer in self.faults.banned,
            on_fault=self.faults.record,
        )
        self.gossip = Gossip(
            self.p2p,
            self.rpc,
            run_id=self.run_id,
            me=self.me,
            codec=self.codec,
            limits=self.limits,
            faults=self.faults,
            max_body_bytes=int(cfg.max_message_mb * 2**20),
            streams=cfg.streams_per_transfer,
            parallel_threshold=int(cfg.parallel_threshold_mb * 2**20),
            max_wait_s=cfg.max_wait_s,
        )
        self.state_server = StateServer(self.run_id)

    async def _connect(self) -> None:
        """Our P2P daemon and DHT node, joined to the initial peers; the swarm's run spec settled."""
        self.p2p = await P2P.create(
            initial_peers=list(self.opts.initial_peers) or None,
            host_maddrs=list(self.opts.host_maddrs),
            announce_maddrs=list(self.opts.announce_maddrs) or None,
            identity_path=str(self.opts.identity) if self.opts.identity else None,
        )
        self.me = self.p2p.peer_id.to_base58()
        self.maddrs = await self.p2p.get_visible_maddrs()
        self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=list(self.opts.initial_peers) or None)
        await self._settle_spec()

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        t_launch = time.perf_counter()
        hb_task: asyncio.Task | None = None
        report_task: asyncio.Task | None = None
        try:
            await self._connect()
            self.run_id = self.spec.hash()[:16]
            self.limits = Limits.from_network(self.spec.network)
            self.faults = Faults(self.spec.network.max_faults_before_ban)
            # Announce ourselves at once (a joiner as not yet admitted), then build while it propagates.
            self.join_round = NOT_ADMITTED if self.opts.initial_peers else 0
            await store_heartbeat(
                self.dht,
                self.run_id,
                self.me,
                {
                    "round": 0,
                    "join_round": self.join_round,
                    "step": 0,
                    "version": __version__,
                    "maddrs": [str(m) for m in self.maddrs],
                },
                self.spec.network.heartbeat_ttl_s,
            )
            first_heartbeat_s = time.perf_counter() - t_launch
            first_heartbeat_at = time.time()
            shard = self.opts.shard or (int(self.me.encode().hex()[-8:], 16) % 64, 64)
            await self.compute(self._build, shard)
            self.metrics = Metrics(self.opts.metrics_port, self.me, host=self.opts.metrics_host)
            self.codec = self._payload_codec()
            self._make_services()
            warm = asyncio.get_running_loop().run_in_executor(self.codec_pool, self.codec.warm_up)
            await self.rpc.add(self.gossip.service())
            await self.rpc.add(self.state_server.service())
            if self.spec.outer.algo == "diloco":
                await self._start_averager()
            resumed = await self.compute(self._resume)
            await warm
            if self.opts.initial_peers:
                await self._enter_swarm(resumed)
            self.state_server.snapshot = await self.compute(lambda: Snapshot.take(self.round, self._state_tensors()))
            await self._heartbeat()
            hb_task = asyncio.create_task(self._heartbeat_loop())
            if self.reporter is not None:
                report_task = asyncio.create_task(self._report_loop())
            if self.opts.announce_file:
                self.opts.announce_file.write_text("\n".join(str(m) for m in self.maddrs) + "\n")
            self.events.write(
                "started",
                peer=self.me,
                maddrs=[str(m) for m in self.maddrs],
                round=self.round,
                run=self.run_id,
                resumed=resumed,
                first_heartbeat_s=first_heartbeat_s,
                first_heartbeat_at=first_heartbeat_at,
                metrics_port=self.metrics.port,
                algo=self.spec.outer.algo,
            )
            log.info("peer %s up; others join with --initial-peers %s", self.me, self.maddrs[0] if self.maddrs else "?")
            if self.opts.wait_for_peers > 1:
                await self._wait_for_peers(self.opts.wait_for_peers)
            self.started = True
            initial_val = await self.compute(self.trainer.evaluate)
            self.val_loss = initial_val
            self.events.write("eval", round=self.round, val_loss=initial_val)
            # --rounds counts the rounds this process trains; otherwise run to the end of the spec's schedule.
            schedule_end = math.ceil(self.spec.train.steps / self.spec.outer.inner_steps)
            end_round = self.round + self.opts.rounds if self.opts.rounds is not None else schedule_end
            if self.opts.until_round is not None:
                end_round = self.opts.until_round
            await self._train(end_round)
            final_val = await self.compute(self.trainer.evaluate)
            self.val_loss = final_val
            await self.compute(self._checkpoint)
            if self.opts.final_weights and not self.stop.is_set():
                from safetensors.torch import save_file  # noqa: PLC0415

                await self.compute(
                    save_file, {k: v.contiguous() for k, v in self.algo.phi.items()}, str(self.opts.final_weights)
                )
            g = self.gossip.stats
            self.summary = {
                "peer": self.me,
                "rounds_completed": self.round,
                "initial_loss": initial_val,
                "final_loss": final_val,
                "bytes_sent": self._bytes_sent(),
                "bytes_received": self._bytes_received(),
                "exchanges_ok": g.exchanges_ok,
                "exchanges_failed": g.exchanges_failed,
                "bytes_undelivered": g.bytes_undelivered,
                "pushes_ok": g.pushes_ok,
                "pushes_failed": g.pushes_failed,
                "pulls": g.pulls,
                "unreachable": g.unreachable,
                "transfers_cut": self.rpc.stats.cut,
                "faults": self.faults.total,
                "banned": len(self.faults.banned),
                "banned_peers": sorted(self.faults.banned),
                "wait_s": self.wait_s,
                "wall_s": time.perf_counter() - self.t_train,
                "steps": self.trainer.step,
                "members": self.members,
                "first_heartbeat_s": first_heartbeat_s,
                "errors_answered": dict(self.rpc.stats.errors_answered),
                "interrupted": self.stop.is_set(),
            }
            self.events.write("finished", **self.summary)
            if self.reporter is not None:
                with contextlib.suppress(Exception):
                    self.reporter.finish(self.summary)
            return self.summary
        finally:
            self.stop.set()
            for task in (hb_task, report_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self._shutdown()

    async def _start_averager(self) -> None:
        from locomm.peer.averaging import AveragerExchange  # noqa: PLC0415 - only the DiLoCo baseline

        assert self.dht is not None
        bootstrap: list[str] = []
        for _ in range(120 if self.opts.initial_peers else 1):  # a joiner needs someone's averager address
            beats = [b for b in await read_heartbeats(self.dht, self.run_id) if b.peer != self.me]
            bootstrap = [m for b in beats for m in b.fields.get("avg_maddrs", []) or [] if isinstance(m, str)]
            if bootstrap or not self.opts.initial_peers:
                break
            await asyncio.sleep(0.5)
        names = [t.name for t in self.codec.tensors]
        shapes = {t.name: torch.Size(t.shape) for t in self.codec.tensors}
        group = self.opts.wait_for_peers if self.opts.wait_for_peers > 1 else None
        # Built on the loop's thread: DecentralizedAverager installs signal handlers, which only the
        # main thread may do. It blocks the loop for a moment at start-up, before any training.
        # The all-reduce's deadline is sized by its bytes like every transfer's: each member sends and
        # receives 2 * S * (N - 1) / N < 2 S bytes, at no less than the floor rate.
        net = self.spec.network
        payload_bytes = 4 * sum(math.prod(t.shape) for t in self.codec.tensors)
        allreduce_s = net.request_timeout_s + 2 * payload_bytes / (net.min_rate_mbit * 1e6 / 8)
        self.averager = AveragerExchange(
            names,
            shapes,
            run_id=self.run_id,
            initial_peers=bootstrap,
            timeout=net.request_timeout_s,
            allreduce_timeout=allreduce_s,
            group_size=group,
        )

    async def _shutdown(self) -> None:
        if self.averager is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.averager.shutdown)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if self.dht is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.dht.shutdown(), 10)
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.p2p.shutdown(), 10)
        self.pool.shutdown(wait=True)
        self.codec_pool.shutdown(wait=False, cancel_futures=True)
        self.events.close()


def _finite(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None

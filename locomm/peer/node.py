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
   inner steps compute, and its result is applied one round late, keeping the
   local progress made meanwhile (theta <- phi_new + (theta_now - theta_sent));
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
from locomm.config import ConfigError, RunSpec
from locomm.protocol import build_outer
from locomm.protocol.messages import TensorSpec
from locomm.peer.gossip import Gossip
from locomm.peer.metrics import EventLog, Metrics
from locomm.peer.state import Snapshot, StateServer, fetch_state
from locomm.peer.swarm import fetch_spec, members_for_round, publish_spec, read_heartbeats, store_heartbeat

log = logging.getLogger(__name__)
JOIN_MARGIN_ROUNDS = 2
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


class Node:
    def __init__(self, spec: RunSpec, opts: NodeOptions) -> None:
        if spec.outer.algo not in ("noloco", "gasloc", "sparseloco", "diloco"):
            raise ConfigError(f"outer.algo: the peer daemon runs noloco, gasloc, sparseloco or diloco; "
                              f"{spec.outer.algo!r} is a simulator baseline (locomm-peer simulate)")
        self.spec = spec
        self.opts = opts
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="locomm-compute")
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
            raise SpecMismatch(f"the swarm speaks protocol {remote['version']}, this peer {PROTOCOL_VERSION}; "
                               "upgrade locomm")
        if self.opts.spec_from_user and remote["hash"] != self.spec.hash():
            raise SpecMismatch(f"the swarm's run spec {remote['hash'][:12]} differs from yours "
                               f"{self.spec.hash()[:12]}; join without --config to take the swarm's")
        spec = RunSpec.from_toml(remote["toml"])
        if spec.hash() != remote["hash"]:
            raise SpecMismatch("the swarm's published spec does not match its own hash")
        self.spec = spec

    def _build(self, shard: tuple[int, int]) -> None:
        from locomm.train import Trainer, resolve_device  # noqa: PLC0415

        self.trainer = Trainer(self.spec, device=resolve_device(self.opts.device), worker_id=shard[0],
                               num_workers=shard[1])
        self.algo = build_outer(self.spec.outer, self.params(), self.me)

    def _expected_payload(self) -> dict[str, TensorSpec]:
        return {f"{prefix}/{k}": TensorSpec(tuple(p.shape)) for prefix in self.algo.payload_prefixes
                for k, p in self.params().items()}

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {**{f"model/{k}": v for k, v in self.algo.phi.items()},
                **{f"outer/{k}": v for k, v in self.algo.state_dict().items()}}

    def _load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        model = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        outer = {k[len("outer/"):]: v for k, v in tensors.items() if k.startswith("outer/")}
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
            got = await fetch_state(self.p2p, run_id=self.run_id, me=self.me, donors=donors,
                                    timeout=self.spec.network.request_timeout_s, max_bytes=max_bytes)
            if got is None:
                log.warning("could not download state from %d donors; starting from the initial weights",
                            len(donors))
                self.events.write("sync_failed", donors=len(donors))
            else:
                donor_round, tensors = got
                await self.compute(self._load_state, tensors)
                self.events.write("synced", donor_round=donor_round, tensors=len(tensors))
                log.info("synced state of round %d from %d donor(s)", donor_round, len(donors))
        self.round = self.join_round
        self.trainer.step = self.round * self.spec.outer.inner_steps

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
        record = {"round": self.round, "join_round": self.join_round, "step": self.trainer.step,
                  "started": self.started,
                  "loss": _finite(self.last_loss), "val_loss": _finite(self.val_loss),
                  "tokens_per_s": self.tokens_per_s, "bytes_sent": self.gossip.stats.bytes_sent,
                  "last_exchange": self.gossip.stats.last_exchange, "version": __version__,
                  "maddrs": [str(m) for m in self.maddrs],
                  "avg_maddrs": self.averager.maddrs() if self.averager is not None else []}
        await store_heartbeat(self.dht, self.run_id, self.me, record, self.spec.network.heartbeat_ttl_s)

    async def _heartbeat_loop(self) -> None:
        while not self.stop.is_set():
            try:
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
                return {self.me: plan.payload}, 0
            mean, group = out
            return {"group-mean": mean}, group - 1
        got = await self.gossip.exchange(round_idx, plan.peers, plan.payload)
        return {self.me: plan.payload, **got}, len(got)

    async def _finish(self, pending: tuple[int, Any, dict, asyncio.Task] | None) -> int:
        """Wait for an in-flight exchange and apply it; returns how many partners answered."""
        if pending is None:
            return 0
        r, plan, sent, task = pending
        t0 = time.perf_counter()
        if self.stop.is_set():  # shutting down: give the exchange a few seconds, not a full timeout
            done, _ = await asyncio.wait({task}, timeout=5.0)
            if not done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return 0
        inputs, answered = await task
        self.wait_s += time.perf_counter() - t0
        await self.compute(self._apply, r, sent, inputs)
        self.last_answered = answered
        return answered

    async def _train(self, end_round: int) -> None:
        assert self.dht is not None
        H = self.spec.outer.inner_steps
        eval_rounds = max(1, self.spec.train.eval_interval // H) if self.spec.train.eval_interval else 0
        pending: tuple[int, Any, dict, asyncio.Task] | None = None
        t_start = time.perf_counter()
        while self.round < end_round and not self.stop.is_set():
            self.gossip.advance(self.round)
            t0 = time.perf_counter()
            losses = []
            for _ in range(H):
                losses.append(await self.compute(self.trainer.train_step))
                if pending is not None and pending[3].done():
                    await self._finish(pending)
                    pending = None
                if self.stop.is_set():
                    break
            self.last_loss = sum(losses) / len(losses)
            self.tokens_per_s = len(losses) * self.trainer.tokens_per_step / (time.perf_counter() - t0)
            await self._finish(pending)
            pending = None
            if self.stop.is_set():  # stopping: no new exchange; the last partial round stays local
                break
            members = members_for_round(await read_heartbeats(self.dht, self.run_id), self.round, self.me,
                                        self.gossip.banned)
            plan, sent = await self.compute(self._plan, self.round, members)
            task = asyncio.create_task(self._exchange(self.round, plan))
            pending = (self.round, plan, sent, task)
            if not self.opts.overlap:
                await self._finish(pending)
                pending = None
            self.round += 1
            if eval_rounds and self.round % eval_rounds == 0:
                self.val_loss = await self.compute(self.trainer.evaluate)
            wall = time.perf_counter() - t_start
            self.metrics.set(round=self.round, step=self.trainer.step, loss=self.last_loss,
                             tokens_per_s=self.tokens_per_s, members=len(members),
                             bytes_sent=self.gossip.stats.bytes_sent, bytes_received=self.gossip.stats.bytes_received,
                             wait_s=self.wait_s)
            self.events.write("round", round=self.round, step=self.trainer.step, loss=self.last_loss,
                              val_loss=_finite(self.val_loss), members=len(members), peers=len(plan.peers),
                              answered=self.last_answered, bytes_sent=self.gossip.stats.bytes_sent,
                              wait_s=self.wait_s, wall_s=wall, tokens_per_s=self.tokens_per_s)
            if self.opts.checkpoint_every and self.round % self.opts.checkpoint_every == 0:
                await self.compute(self._checkpoint)
            hb = asyncio.create_task(self._heartbeat())  # fresh round numbers keep joiners' choices right
            hb.add_done_callback(lambda t: t.cancelled() or t.exception())
        await self._finish(pending)

    # -- main --------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        t_launch = time.perf_counter()
        hb_task: asyncio.Task | None = None
        try:
            self.p2p = await P2P.create(initial_peers=list(self.opts.initial_peers) or None,
                                        host_maddrs=list(self.opts.host_maddrs),
                                        announce_maddrs=list(self.opts.announce_maddrs) or None,
                                        identity_path=str(self.opts.identity) if self.opts.identity else None)
            self.me = self.p2p.peer_id.to_base58()
            self.maddrs = await self.p2p.get_visible_maddrs()
            self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=list(self.opts.initial_peers) or None)
            await self._settle_spec()
            self.run_id = self.spec.hash()[:16]
            # Announce ourselves at once (a joiner as not yet admitted), then build while it propagates.
            self.join_round = NOT_ADMITTED if self.opts.initial_peers else 0
            await store_heartbeat(self.dht, self.run_id, self.me, {"round": 0, "join_round": self.join_round,
                                  "step": 0, "version": __version__, "maddrs": [str(m) for m in self.maddrs]},
                                  self.spec.network.heartbeat_ttl_s)
            first_heartbeat_s = time.perf_counter() - t_launch
            first_heartbeat_at = time.time()
            shard = self.opts.shard or (int(self.me.encode().hex()[-8:], 16) % 64, 64)
            await self.compute(self._build, shard)
            self.metrics = Metrics(self.opts.metrics_port, self.me)
            cfg = self.spec.network
            sparse = self.algo.payload_prefixes == ("sparse",)
            self.gossip = Gossip(
                self.p2p, run_id=self.run_id, me=self.me, expected=self._expected_payload(),
                codec=self.spec.compression.outer_gradient if _codec_available(self.spec.compression.outer_gradient)
                else "none",
                timeout=cfg.request_timeout_s, max_body_bytes=int(cfg.max_message_mb * 2**20),
                max_faults=cfg.max_faults_before_ban,
                raw_bytes_tensors=frozenset(self._expected_payload()) if sparse else frozenset(),
                raw_decoder=(next(iter(self.algo.codecs.values())).decode if sparse else None))
            self.state_server = StateServer(self.p2p, self.run_id, cfg.request_timeout_s)
            await self.gossip.start()
            await self.state_server.start()
            if self.spec.outer.algo == "diloco":
                await self._start_averager()
            resumed = await self.compute(self._resume)
            if self.opts.initial_peers:
                await self._enter_swarm(resumed)
            self.state_server.snapshot = await self.compute(lambda: Snapshot.take(self.round, self._state_tensors()))
            await self._heartbeat()
            hb_task = asyncio.create_task(self._heartbeat_loop())
            if self.opts.announce_file:
                self.opts.announce_file.write_text("\n".join(str(m) for m in self.maddrs) + "\n")
            self.events.write("started", peer=self.me, maddrs=[str(m) for m in self.maddrs], round=self.round,
                              run=self.run_id, resumed=resumed, first_heartbeat_s=first_heartbeat_s,
                              first_heartbeat_at=first_heartbeat_at,
                              metrics_port=self.metrics.port, algo=self.spec.outer.algo)
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

                await self.compute(save_file, {k: v.contiguous() for k, v in self.algo.phi.items()},
                                   str(self.opts.final_weights))
            self.summary = {"peer": self.me, "rounds_completed": self.round, "initial_loss": initial_val,
                            "final_loss": final_val, "bytes_sent": self.gossip.stats.bytes_sent,
                            "bytes_received": self.gossip.stats.bytes_received,
                            "exchanges_ok": self.gossip.stats.exchanges_ok,
                            "exchanges_failed": self.gossip.stats.exchanges_failed,
                            "wait_s": self.wait_s, "first_heartbeat_s": first_heartbeat_s,
                            "errors_answered": dict(self.gossip.stats.errors_answered),
                            "interrupted": self.stop.is_set()}
            self.events.write("finished", **self.summary)
            return self.summary
        finally:
            self.stop.set()
            if hb_task is not None:
                hb_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await hb_task
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
        names = sorted(self._expected_payload())
        shapes = {n: torch.Size(self._expected_payload()[n].shape) for n in names}
        group = self.opts.wait_for_peers if self.opts.wait_for_peers > 1 else None
        # Built on the loop's thread: DecentralizedAverager installs signal handlers, which only the
        # main thread may do. It blocks the loop for a moment at start-up, before any training.
        self.averager = AveragerExchange(names, shapes, run_id=self.run_id, initial_peers=bootstrap,
                                         timeout=self.spec.network.request_timeout_s, group_size=group)

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
        self.events.close()


def _finite(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


def _codec_available(name: str) -> bool:
    """The run's outer-gradient codec when this build has it (a single lossless codec), else raw."""
    if "+" in name or name in ("none", ""):
        return False
    try:
        from locomm.compression import get_codec  # noqa: PLC0415

        get_codec(name)
        return True
    except Exception:  # noqa: BLE001 - compression library absent or codec unknown
        return False

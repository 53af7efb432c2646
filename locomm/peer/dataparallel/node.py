"""The data-parallel driver: the whole model in one worker thread, outer rounds by gossip (or DiLoCo's
all-reduce), composed on the :class:`~locomm.peer.host.Host`.

Lifecycle of ``Node.run()``:
1. the host is up (P2P, DHT node, the settled run spec, the RPC server, metrics);
2. build the trainer and outer algorithm in the worker thread; resume from the own checkpoint, or
   download state from live peers when joining a running swarm;
3. train: H inner steps per round in the worker thread, then the round's exchange over P2P streams.
   With ``overlap`` the exchange runs while the next round's inner steps compute, and its result is
   applied one round late whenever it arrived, keeping the local progress made meanwhile
   (``protocol/rounds.py``: theta <- phi_new + (theta_now - theta_sent));
4. on SIGINT/SIGTERM or the last round: finish the pending exchange, checkpoint atomically; the
   host then stops every task it started and shuts P2P and the DHT down.

Everything that touches the model (steps, plan, apply, snapshots) runs in the single worker thread,
so no two of them ever race.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from locomm import __version__
from locomm.checkpoint import save_tensors_atomic
from locomm.compression.payload import PayloadCodec
from locomm.config import ConfigError, RunSpec
from locomm.peer.dataparallel.partners import Partners
from locomm.peer.host import Host
from locomm.peer.options import NodeOptions
from locomm.peer.presence import JOIN_MARGIN_ROUNDS, Presence, finish_or_stop, finite
from locomm.peer.transport.state_sync import (
    Judge,
    Snapshot,
    StateServer,
    expected_layout,
    load_state,
    loss_verdict,
    state_tensors,
)
from locomm.protocol import build_outer
from locomm.protocol import rounds as schedule
from locomm.protocol.membership import (
    DONOR_MIN_AGE_ROUNDS,
    NOT_ADMITTED,
    Heartbeat,
    islands_led,
    state_donors,
    swarm_round,
)
from locomm.protocol.timing import ema

__all__ = ["Node"]

log = logging.getLogger(__name__)
STOP_EXCHANGE_S = 10.0  # after Ctrl-C, how long the pending exchange may still take (a second Ctrl-C: none)


class Node:
    """One data-parallel peer (see the module docstring)."""

    def __init__(self, spec: RunSpec, opts: NodeOptions, island: Callable[..., Any] | None = None) -> None:
        """``island``: with ``opts.island``, what builds the island member (``peer.island.member.Island``, handed in
        by the CLI: drivers do not import each other), called ``island(node, name, size, key)``."""
        if opts.island is not None and island is None:
            raise ConfigError("--island: this node was built without an island member")
        if spec.outer.algo not in ("noloco", "gasloc", "sparseloco", "diloco"):
            raise ConfigError(
                f"outer.algo: the peer daemon runs noloco, gasloc, sparseloco or diloco; "
                f"{spec.outer.algo!r} is a simulator baseline (locomm-peer simulate)"
            )
        self.spec = spec
        self.opts = opts
        self.host: Host
        self.presence: Presence
        self.roster: Partners
        self._attack_gen = torch.Generator().manual_seed(spec.train.seed)
        self.averager: Any = None
        self.island: Any = None
        self._make_island = island
        self.round = self.join_round = 0
        self.end_round: int | None = None
        self.round_t0, self.round_s, self.phase = time.time(), 0.0, "starting"
        self.members = self.partners = self.last_answered = 0
        self.t_train = time.perf_counter()
        self.avg_bytes = 0
        self.last_loss = self.val_loss = float("nan")
        self.tokens_per_s = self.wait_s = 0.0
        self.parts_s: dict[str, float] = {}
        """The last apply, snapshot, plan and exchange durations (round events: where the time goes)."""
        self.step_in_round = 0
        self.summary: dict[str, Any] = {}

    # -- helpers -----------------------------------------------------------------------

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.trainer.model.named_parameters())

    def _build(self, shard: tuple[int, int]) -> None:
        from locomm.train import Trainer  # noqa: PLC0415

        device, plan = self.host.device_and_plan()
        self.trainer = Trainer(
            self.spec,
            device=device,
            plan=plan,
            worker_id=shard[0],
            num_workers=shard[1],
            stream=self.host.stream_key(),
        )
        self.algo = build_outer(self.spec.outer, self.params(), self.host.me)
        self.codec = PayloadCodec(
            {k: tuple(p.shape) for k, p in self.params().items()},
            self.algo.payload_roles,
            self.spec.compression,
            encoded=self.algo.payload_encoded,
        )
        self.rounds = schedule.Rounds.of_spec(self.algo, self.spec)

    def _sent_params(self) -> dict[str, torch.Tensor]:
        """The weights a round's plan sends from: our own, or (``--attack``, benchmarks only) an attacker's."""
        if self.opts.attack is None:
            return self.params()
        from locomm.protocol.attacks import corrupt  # noqa: PLC0415 - benchmarks only

        return corrupt(self.opts.attack, self.params(), self.algo.phi, self._attack_gen)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_state(tensors, self.params(), self.algo)

    def _judge(self, beats: list[Heartbeat]) -> Judge:
        """The check of a downloaded state before we train on it: its loss on our held-out batches (the spec's
        validation windows) against the training losses the members publish and our own weights' loss
        (``state_sync.loss_verdict``)."""
        published = [b.loss for b in beats if b.started]
        own: list[float] = []

        async def judge(tensors: dict[str, torch.Tensor]) -> str | None:
            if not own:
                own.append(await self.host.compute(self.trainer.evaluate))
            return loss_verdict(await self.host.compute(self._state_loss, tensors), published, own[0])

        return judge

    def _state_loss(self, tensors: dict[str, torch.Tensor]) -> float:
        """The validation loss of ``tensors``' model weights; ours are put back after (a CPU copy meanwhile)."""
        params = self.params()
        keep = {k: p.detach().to("cpu", copy=True) for k, p in params.items()}
        try:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(tensors[f"model/{k}"])
            return self.trainer.evaluate()
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(keep[k])

    def _resume(self) -> bool:
        if self.opts.checkpoint_dir is None:
            return False
        ckpt = self.trainer.try_resume(self.opts.checkpoint_dir)
        if self.trainer.set_aside is not None:  # unreadable: kept aside for the user; we sync from the swarm
            self.host.events.write("checkpoint_set_aside", **self.trainer.set_aside.event())
        if ckpt is None:
            return False
        self.algo.load_state_dict(ckpt.aux)
        self.round = int(ckpt.extra.get("round", 0))
        return True

    def _checkpoint(self) -> None:
        """Write the checkpoint; one that cannot be written (a full disk) is a fault of the machine: logged and
        reported, the last good checkpoint stays, training goes on."""
        if self.opts.checkpoint_dir is None:
            return
        try:
            self.trainer.save(self.opts.checkpoint_dir, aux=self.algo.state_dict(), extra={"round": self.round})
        except OSError as e:
            log.error("could not write the checkpoint in %s (%s); the last one stays", self.opts.checkpoint_dir, e)
            self.host.events.write("checkpoint_failed", round=self.round, errno=e.errno, error=str(e))

    def _snapshot(self, round_idx: int) -> None:
        # A joiner downloads the last outer point (phi) and the outer state.
        self.state_server.snapshot = Snapshot.take(round_idx, state_tensors(self.algo.phi, self.algo))

    def bytes_sent(self) -> int:
        return self.gossip.stats.bytes_sent + self.avg_bytes

    def bytes_received(self) -> int:
        return self.gossip.stats.bytes_received + self.avg_bytes

    def heartbeat(self) -> Heartbeat:
        h, g, c = self.host, self.gossip.stats, self._counters()
        return self.presence.beat(
            **{k: c[k] for k in ("round", "step", "loss", "val_loss", "tokens_per_s", "bytes_sent")},
            join_round=self.join_round,
            eta_s=self._eta_s(),
            last_exchange=g.last_exchange,
            avg_maddrs=tuple(self.averager.maddrs()) if self.averager is not None else (),
            # What partners need for an ETA of our payload: when this round's compute began, how long
            # a round takes us, how fast we upload, to how many partners.
            round_t0=self.round_t0,
            round_s=self.round_s,
            up_Bps=g.up_Bps,
            partners=self.partners,
            banned=len(h.faults.banned),
            **(self.island.beat_fields() if self.island is not None else {}),
        )

    def _eta_s(self) -> float | None:
        """Seconds left of this round's inner steps at our pace (None when not training or not yet timed)."""
        if self.phase != "training" or not self.round_s:
            return None
        H = self.spec.outer.inner_steps
        return max(0.0, (H - self.step_in_round) * self.round_s / H)

    def _counters(self) -> dict[str, Any]:
        """What the live display, the round event and the metrics share."""
        return {
            "round": self.round,
            "step": self.trainer.step,
            "loss": finite(self.last_loss),
            "val_loss": finite(self.val_loss),
            "tokens_per_s": self.tokens_per_s,
            "members": self.members,
            "bytes_sent": self.bytes_sent(),
            "bytes_received": self.bytes_received(),
            "wait_s": self.wait_s,
        }

    def status(self) -> dict[str, Any]:
        """What the node is doing now, for the live display (locomm.cli.display)."""
        h = self.host
        return {
            **self._counters(),
            "peer": h.me[-8:],
            "end_round": self.end_round,
            "partners": self.partners,
            "answered": self.last_answered,
            "wall_s": time.perf_counter() - self.t_train,
            "phase": self.phase,
            "transfers": [m.view() for m in list(h.rpc.meters)],
            "faults": h.faults.total,
            "banned": len(h.faults.banned),
        }

    # -- the presence's hooks (peer/presence.py) ------------------------------------------

    @property
    def step(self) -> int:
        return self.trainer.step

    def describe(self) -> dict[str, Any]:
        return {}

    async def may_pause(self) -> str | None:
        if self.island is not None:  # its island would drop it and resync it; not built or tested yet
            return "an island member cannot pause yet: stop it (Ctrl-C) and its island goes on"
        return None

    async def drain(self) -> None:
        """Nothing to do: the round loop pauses only once its pending exchange is applied (``_train``)."""

    def undrain(self) -> None:
        pass

    def snapshot(self, round_idx: int) -> None:
        self._snapshot(round_idx)

    async def resync(self) -> None:
        await self._enter(resumed=None)

    async def run_over(self) -> bool:
        return False  # a paused data-parallel peer waits for resume or stop, whatever the swarm does

    async def _enter(self, resumed: bool | None) -> None:
        """Pick the round to join at, a little ahead of the swarm's (the admitted peers' median, robust_top:
        one peer claiming round 10^9 cannot send us there), and download the state unless we resumed our own.
        ``resumed=None`` (back from a pause): our own state is current unless the swarm moved past our round."""
        host = self.host
        # The first reads after the DHT bootstrap can miss part of the swarm: read until two agree before taking
        # its round (a peer restarted from an old checkpoint that sees nobody further along trains on at its own
        # round; in a chaos run one trained at round 4 while the swarm was at 18, every push STALE_ROUND).
        await host.settle_view()
        beats = [b for b in await host.read_beats() if b.peer != host.me]
        top = swarm_round(beats)
        if resumed is None:
            resumed = top <= self.round
        if all(not b.started for b in beats) and (top == 0 or (resumed and top == self.round)):
            # Nobody has trained yet (a new swarm, or a stopped one restarting from checkpoints of one round): start
            # together.
            self.join_round = self.round
            return
        # Join a little ahead of the swarm, so every peer counts us from the same round on: peers that computed a
        # round's membership before our heartbeat reached them never expect us in it.
        self.join_round = max(top + JOIN_MARGIN_ROUNDS, self.round)
        await host.publish()
        if not resumed and top > 0:
            self.phase = "syncing"
            expected = expected_layout(state_tensors(self.algo.phi, self.algo))  # what _snapshot serves
            await self.presence.download(
                lambda bs, groups, ages: state_donors(
                    bs,
                    swarm_round(bs),
                    _round,
                    prefer=host.trusted,
                    groups=groups,
                    since=ages,
                    young_after=swarm_round(bs) - DONOR_MIN_AGE_ROUNDS,
                ),
                expected,
                self.load_state,
                self._judge(beats),
            )
            if host.stop.is_set():  # stopping mid-sync: our round and weights stay what they were
                return
            # The swarm moved on while we synced: join ahead of where it is now, not where it was (a peer that
            # starts rounds behind the others trains alone and never catches up). A peer that read our first
            # join_round may plan us into a round or two before the new one; it skips us at that round's deadline.
            now_top = swarm_round([b for b in await host.read_beats() if b.peer != host.me])
            if now_top + JOIN_MARGIN_ROUNDS > self.join_round:
                self.join_round = now_top + JOIN_MARGIN_ROUNDS
                await host.publish()
        self.round = self.join_round
        self.trainer.step = self.round * self.spec.outer.inner_steps
        await host.settle_view()

    def _summary(self, initial_val: float, final_val: float, first_heartbeat_s: float) -> dict[str, Any]:
        g = self.gossip.stats
        counted = ("bytes_undelivered", "pushes_ok", "pushes_failed", "pulls", "gave_up", "gone_skipped", "gave_up_on")
        return self.presence.summary(
            self.gossip,
            rounds=self.round,
            steps=self.trainer.step,
            initial=initial_val,
            final=final_val,
            t0=self.t_train,
            bytes_sent=self.bytes_sent(),
            bytes_received=self.bytes_received(),
            **{k: getattr(g, k) for k in counted},
            unreachable=g.unreachable,
            wait_s=self.wait_s,
            members=self.members,
            first_heartbeat_s=first_heartbeat_s,
            **({"island": self.island.summary()} if self.island is not None else {}),
        )

    # -- start-up ----------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        async with Host(self.spec, self.opts) as host:
            self.host, self.spec = host, host.spec
            return await self._run(host)

    async def _run(self, host: Host) -> dict[str, Any]:
        # Announce ourselves at once (a joiner as not yet admitted), then build while it propagates.
        self.join_round = NOT_ADMITTED if self.opts.initial_peers else 0
        await host.publish(
            Heartbeat(
                peer=host.me, join_round=self.join_round, version=__version__, maddrs=tuple(map(str, host.maddrs))
            )
        )
        first_heartbeat_s = time.perf_counter() - host.t_launch
        first_heartbeat_at = time.time()
        self.presence = Presence(host, self)
        await host.compute(self._build, host.default_shard())
        self.gossip = host.gossip(self.codec)
        self.roster = Partners(host, self.spec, self.codec.raw_bytes())
        self.gossip.admit = self.roster.admit  # only a round's partners may push to us
        self.presence.wire(self.gossip)
        self.gossip.on_serving = self.host.publish_soon  # ours failed: say so, partners pull it
        self.state_server = StateServer(host.run_id)
        warm = asyncio.get_running_loop().run_in_executor(host.codec_pool, self.codec.warm_up)
        await host.serve(self.gossip.service(), self.state_server.service())
        if self._make_island is not None and self.opts.island is not None:  # SCAPE every step (peer/island/)
            self.island = self._make_island(self, self.opts.island, self.opts.island_size, self.opts.island_key)
            await host.serve(self.island.service())
        if self.spec.outer.algo == "diloco":
            await self._start_averager()
        resumed = await host.compute(self._resume)
        await warm
        host.heartbeat = self.heartbeat
        await self.presence.start_control(lambda: {"step": self.trainer.step})
        if self.opts.initial_peers:
            await self._enter(resumed)
        await host.compute(self._snapshot, self.round)
        await host.publish()
        host.start_reporter(self.status)
        host.up(
            round=self.round,
            resumed=resumed,
            first_heartbeat_s=first_heartbeat_s,
            first_heartbeat_at=first_heartbeat_at,
            metrics_port=host.metrics.port,
        )
        if self.island is not None:  # after up: the other members may be waiting for our address
            await self.island.form()
        if (n := self.opts.wait_for_peers) > 1:

            def admitted(beats: list[Heartbeat]) -> bool:
                n_in = len({b.peer for b in beats if b.join_round <= self.round} | {host.me})
                return n_in >= n and islands_led(beats)  # an island counts from its representative on

            await host.wait_for(admitted, 60.0, f"{n} admitted peers")
        self.presence.started = True
        initial_val = await self._evaluate()
        # --rounds counts the rounds this process trains; otherwise run to the end of the spec's schedule.
        schedule_end = math.ceil(self.spec.train.steps / self.spec.outer.inner_steps)
        end_round = self.round + self.opts.rounds if self.opts.rounds is not None else schedule_end
        if self.opts.until_round is not None:
            end_round = self.opts.until_round
        await self._train(end_round)
        net = self.spec.network  # a partner a round behind takes our last payload up to a round later
        handover_s = max(net.request_timeout_s, self.round_s)
        await self.presence.leave(self.gossip, self.round - 1, handover_s, net.max_wait_s, net.heartbeat_ttl_s)
        final_val = math.nan if host.hurry.is_set() else await self._evaluate()
        await host.compute(self._checkpoint)
        if self.opts.final_weights and not host.stop.is_set():
            await host.compute(save_tensors_atomic, self.opts.final_weights, self.algo.phi)
        self.summary = self._summary(initial_val, final_val, first_heartbeat_s)
        host.events.write("finished", **self.summary)
        host.report("finish", self.summary)
        return self.summary

    async def _evaluate(self) -> float:
        """Validation loss now, logged as an ``eval`` event (what ``locomm-peer plot`` draws)."""
        self.val_loss = await self.host.compute(self.trainer.evaluate)
        self.host.events.write("eval", round=self.round, step=self.trainer.step, val_loss=self.val_loss)
        return self.val_loss

    async def _start_averager(self) -> None:
        from locomm.peer.dataparallel.averaging import start_averager  # noqa: PLC0415 - only the DiLoCo baseline

        group = self.opts.wait_for_peers if self.opts.wait_for_peers > 1 else None
        self.averager = await start_averager(self.host, self.codec, group_size=group)

    # -- rounds ------------------------------------------------------------------------

    def _apply(self, received: dict[str, Any]) -> None:
        """The pending round's outer update, one round late, keeping local progress (protocol/rounds.py)."""
        t0 = time.perf_counter()
        r = self.rounds.settle(self.params(), received)
        t1 = time.perf_counter()
        self._snapshot(r if r is not None else self.round)
        self.parts_s["apply_s"], self.parts_s["snapshot_s"] = t1 - t0, time.perf_counter() - t1
        if self.island is not None and r is not None:  # the island's followers fetch it (peer/island/member.py)
            self.island.settle_done(r, True)
        self.host.note_screening(r, self.rounds.outcome)

    async def _exchange(self, round_idx: int, planned: schedule.Planned) -> tuple[dict[str, Any], int]:
        """Everything the outer rule needs (our own payload included), and how many partners answered."""
        payload, me = planned.exchange.payload, self.host.me
        if self.averager is not None:  # DiLoCo: hivemind's all-reduce gives the group mean directly
            received, answered, moved = await self.averager.round(me, payload)
            self.avg_bytes += moved
            self.gossip.stats.exchanges_ok += answered
            self.gossip.stats.exchanges_failed += int(answered == 0)
            return received, answered
        eta = self.roster.eta(round_idx, self.round_s)
        t0 = time.perf_counter()
        got = await self.gossip.exchange(round_idx, planned.exchange.peers, payload, eta=eta)
        self.parts_s["exchange_s"] = time.perf_counter() - t0
        return planned.received(me, got), len(got)

    async def _finish(self, task: asyncio.Task | None) -> None:
        """Wait for the in-flight exchange and apply it."""
        if task is None:
            return
        t0 = time.perf_counter()
        if not task.done():
            self.phase = "stopping" if self.host.stop.is_set() else "exchanging"
        # Shutting down, before or meanwhile: the exchange gets a few seconds more (none after a second signal).
        if not await finish_or_stop(self.host, task, STOP_EXCHANGE_S):
            self.rounds.drop()
            return
        received, self.last_answered = task.result()
        self.wait_s += time.perf_counter() - t0
        self.phase = "training"
        await self.host.compute(self._apply, received)

    async def _train(self, end_round: int) -> None:
        host, H = self.host, self.spec.outer.inner_steps
        eval_rounds = self.opts.eval_every
        if eval_rounds is None:
            eval_rounds = max(1, self.spec.train.eval_interval // H) if self.spec.train.eval_interval else 0
        pending: asyncio.Task | None = None
        t_start = time.perf_counter()
        self.end_round = end_round
        self.phase = "training"
        self.t_train = time.perf_counter()
        while self.round < end_round and not host.stop.is_set():
            self.gossip.advance(self.round)
            t0 = time.perf_counter()
            self.round_t0 = host.dht_now()  # in heartbeats: partners place it on the swarm's (DHT) time
            losses, cut = [], False
            # The previous round's exchange runs meanwhile; it is applied exactly one round late whenever it
            # finished (protocol/rounds.py), so the numerics do not depend on the network's speed.
            island = self.island
            self.step_in_round = 0
            while self.step_in_round < H:  # an island's resync may move the step (peer/island/member.py)
                i = self.step_in_round
                if pending is not None and self.rounds.due(i):
                    await self._finish(pending)
                    pending = None
                elif island is not None and i == self.rounds.at:
                    await island.outer_point()  # a follower: the round its representative settled here
                losses.append(await (island.step() if island else host.compute(self.trainer.train_step)))
                self.step_in_round += 1
                if host.stop.is_set() or (cut := self.presence.pause_wanted.is_set()):
                    break
            self.last_loss = sum(losses) / len(losses)
            compute_s = time.perf_counter() - t0
            self.tokens_per_s = len(losses) * self.trainer.tokens_per_step / compute_s
            if len(losses) == H:  # a round cut short by a pause says nothing of our pace
                self.round_s = ema(self.round_s, compute_s)
            await self._finish(pending)
            pending = None
            if host.stop.is_set():  # stopping: no new exchange; the last partial round stays local
                break
            if cut:  # paused (even if resumed since): the partial round stays local; the pause re-enters the swarm
                await self.presence.pause()
                continue
            if island is not None and not island.leading:  # a follower: no exchange of its own
                await island.outer_point()
                await host.compute(island.round_end)
                self.round += 1
                wall = time.perf_counter() - t_start
                host.events.write("round", **self._counters(), island_follower=True, wall_s=wall, compute_s=compute_s)
                host.publish_soon()
                continue
            # Bans are not applied here: every peer must derive the same groups; a banned or unreachable
            # partner is skipped at exchange time instead.
            await host.read_beats()
            members = self.roster.members(self.round)  # from the heartbeats just read
            t_plan = time.perf_counter()
            planned = await host.compute(self.rounds.start, self.round, members, self._sent_params())
            self.parts_s["plan_s"] = time.perf_counter() - t_plan
            self.roster.planned_round(self.round, planned.exchange.peers)
            if island is not None:  # its followers will ask for this round's outer update
                island.planned_round(self.round)
            self.members, self.partners = len(members), len(planned.exchange.peers)
            pending = host.spawn(self._exchange(self.round, planned))
            if not self.opts.overlap:
                await self._finish(pending)
                pending = None
            self.round += 1
            if eval_rounds and self.round % eval_rounds == 0 and self.round < end_round:
                await self._evaluate()
            self._record_round(members, planned, compute_s, time.perf_counter() - t_start)
            if self.opts.checkpoint_every and self.round % self.opts.checkpoint_every == 0:
                await host.compute(self._checkpoint)
            host.publish_soon()  # fresh round numbers keep joiners' choices right
        await self._finish(pending)
        if self.island is not None and not host.stop.is_set():
            await self.island.outer_point()  # a follower: the last round its representative settled

    def _record_round(self, members: list[str], planned: schedule.Planned, compute_s: float, wall: float) -> None:
        host, counters = self.host, self._counters()
        host.metrics.set(**{**counters, "loss": self.last_loss})
        host.events.write(
            "round",
            **{**counters, "loss": self.last_loss},
            peers=len(planned.exchange.peers),
            partners=sorted(planned.exchange.peers),
            member_ids=members,
            answered=self.last_answered,
            wall_s=wall,
            compute_s=compute_s,
            # Where a round's time goes (the last apply, plan and exchange; the codec pool's totals so far).
            **self.parts_s,
            encode_s=self.gossip.stats.encode_s,
            decode_s=self.gossip.stats.decode_s,
            faults=host.faults.total,
        )
        host.report("round_done", self.status())


def _round(b: Heartbeat) -> int:
    return b.round

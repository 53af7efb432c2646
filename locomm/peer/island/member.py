"""Islands: a few peers on a fast link that train as one data-parallel worker (SCAPE every step), joined to
the swarm by gossip through one of them, the representative.

``locomm-peer join --island NAME --island-size N``. The N peers that publish the same island name form it; its
roster (sorted peer ids) gives each a rank, which owns one slice of the SCAPE masks (``protocol/scape.py``). The
representative is drawn: each member commits to a random salt in its heartbeat, reveals it once all have
committed, and the salts order the members (``wire.island_order``), so no one, an outsider grinding peer ids
included, picks it. It alone takes part in the outer rounds (``members_for_round`` skips
the others: their heartbeats say ``island`` without ``island_rep``). ``--island-key FILE`` (a secret or a list of
peer ids, as ``--swarm-key``) closes the island: a member's heartbeat then carries an HMAC of its own peer id, and
a peer that names the island without it is not a member.

Every inner step (the ``island`` service, on the host's exchange layer):

    every member:  grads -> ScapeSync.plan -> message (values on the mask, its mask slice of the next step)
    follower:      island.step request to the representative, carrying its message
    representative: waits for its active followers (or a step deadline), reduces in rank order, and answers
                   each with the one synchronized buffer (values, the next mask); everyone applies the same
                   buffer and steps AdamS on it, so the members stay bit-identical

Outer rounds: the representative plans, exchanges and settles as any peer (``peer/dataparallel/node.py``); a follower
snapshots its weights where the representative planned, and at the step the round lands it fetches the settled
outer state (``island.outer``: phi and the outer algorithm's buffers) and applies
``theta <- theta + (phi - theta_sent)``, the arithmetic of ``protocol/rounds.apply_late``.

Failover: a follower whose request to the representative fails (unreachable, broken, cut, or the peer's final
heartbeat) drops it and takes the next live member in the drawn order; that one leads from its current step, the others
download its state (``island.state``: weights, AdamS state, step, mask, outer state) and go on from there. A
follower that the representative dropped for missing a step's deadline does the same when it comes back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from locomm.config import ConfigError
from locomm.optim.adams import by_param
from locomm.peer.island.representative import Representative
from locomm.peer.island.state import Trainee, apply_outer, load_state, state_header
from locomm.peer.island.wire import (
    NEVER_PLANNED,
    SALT_BYTES,
    LeaderBusy,
    LeaderLost,
    MustResync,
    busy_or_lost,
    island_commitment,
    island_members,
    island_order,
    island_proof,
    read_state,
    read_synced,
    read_tensors,
)
from locomm.peer.transport.meter import TransferCut, Unreachable
from locomm.peer.transport.records import SwarmKey
from locomm.peer.transport.rpc import Call, Service, open_link
from locomm.protocol.membership import live
from locomm.protocol.messages import ErrorCode, ProtocolViolation, envelope
from locomm.protocol.rounds import snapshot
from locomm.protocol.scape import ScapeMessage, ScapeSync, Synced, encode_indices
from locomm.protocol.timing import ema

log = logging.getLogger(__name__)
SERVICE = "island"
NOT_FORMED = "island not formed yet"
BUSY_RETRIES = 40
"""Answers of a live representative that is not ready (forming, not yet leading) retried 0.5 s apart."""
FORM_TIMEOUT_S = 120.0


class Island:
    """One member's side of an island (see the module docstring)."""

    def __init__(self, node: Trainee, name: str, size: int, key: Path | None = None) -> None:
        if node.spec.inner.name != "adams":
            raise ConfigError("--island: SCAPE builds its masks from AdamS's first moment; set inner.name = 'adams'")
        if not node.opts.overlap:
            raise ConfigError("--island needs the overlapped schedule: drop --no-overlap")
        if not 2 <= size <= 64:
            raise ConfigError(f"--island-size: must be in [2, 64], got {size}")
        self.node, self.host, self.name, self.size = node, node.host, name, size
        self.key = SwarmKey.load(key) if key is not None else None
        self.loop = asyncio.get_running_loop()
        self.roster: list[str] = []
        self.order: list[str] = []
        """Who represents the island, first to last (the draw: ``wire.island_order``)."""
        self.leader: str | None = None
        self.commit, self.salt = "", ""
        self.dead: set[str] = set()
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        """theta_sent of the rounds a follower snapshotted and has not landed yet."""
        self.need_resync = False
        self.step_s = 0.0
        self.stats = {"step_bytes_sent": 0, "step_bytes_received": 0, "outer_bytes": 0, "resync_bytes": 0}
        self.stats |= {"steps_synced": 0, "resyncs": 0, "failovers": 0, "dropped": 0, "outer_applied": 0}
        self.digest = ""
        self.rep = Representative(self)
        """The representative's side: its followers' queues and its handlers, in use while we lead."""

    # -- forming -------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.leader == self.host.me

    def beat_fields(self) -> dict[str, Any]:
        proof = island_proof(self.key, self.host.run_id, self.name, self.host.me) if self.key is not None else ""
        draw = {"island_commit": self.commit, "island_salt": self.salt}
        return {"island": self.name, "island_rep": self.leading, "island_proof": proof, **draw}

    def service(self) -> Service:
        rep = self.rep
        handlers = {"island.step": rep.on_step, "island.outer": rep.on_outer, "island.state": rep.on_state}
        return Service(SERVICE, handlers, policy="announced")

    def _live_members(self, beats: list) -> list[str]:
        net = self.node.spec.network
        fresh = live(beats, self.host.dht_now(), net.heartbeat_ttl_s)
        ids = set(island_members(fresh, self.name, self.key, self.host.run_id))
        return sorted((ids | {self.host.me}) - self.dead)

    async def form(self) -> None:
        """Wait for the island's ``size`` members, take ranks and the representative, and start identical."""

        def full(beats: list) -> bool:
            return len(self._live_members(beats)) >= self.size

        await self.host.wait_for(full, FORM_TIMEOUT_S, f"{self.size} members of island {self.name!r}")
        self.roster = self._live_members(await self.host.read_beats())[: self.size]
        if self.host.me not in self.roster:
            raise ConfigError(f"island {self.name!r} already has {self.size} members")
        shapes = {k: tuple(p.shape) for k, p in self.node.params().items()}
        outer = self.node.spec.outer
        self.sync = ScapeSync.of_spec(shapes, outer, rank=self.roster.index(self.host.me), workers=self.size)
        self.order = await self._draw()
        self.leader = self.order[0]
        if self.key is None:
            log.warning("island %s is open: any peer that names it can join (--island-key FILE closes it)", self.name)
        self.rep.active = set(self.roster) - {self.host.me} if self.leading else set()
        self.host.events.write("island", name=self.name, roster=self.roster, order=self.order, leader=self.leader)
        log.info("island %s: %s, representative %s", self.name, [p[-8:] for p in self.roster], self.leader[-8:])
        self.host.publish_soon()  # island_rep: the swarm's rounds count the representative at once
        if not self.leading:
            await self._resync()

    async def _draw(self) -> list[str]:
        """Commit to a random salt, then reveal it once every member of the roster has committed: the salts
        order the representatives (``wire.island_order``), so no peer id, however ground, picks the leader. The
        first commitment seen of each member binds it; a member that reveals another salt, or does not commit or
        reveal within ``FORM_TIMEOUT_S``, stops the island forming (ConfigError naming it)."""
        me, salt = self.host.me, os.urandom(SALT_BYTES)
        commits, salts = {me: island_commitment(salt)}, {me: salt}
        self.commit, self.salt = commits[me], ""
        self.host.publish_soon()

        def committed(beats: list) -> bool:
            for b in beats:
                if b.peer in self.roster and b.island == self.name and b.island_commit:
                    commits.setdefault(b.peer, b.island_commit)
            return set(commits) >= set(self.roster)

        def revealed(beats: list) -> bool:
            for b in beats:
                if b.peer in commits and b.peer not in salts and b.island_salt:
                    try:
                        got = bytes.fromhex(b.island_salt)
                    except ValueError:
                        continue
                    if island_commitment(got) != commits[b.peer]:
                        raise ConfigError(f"island {self.name!r}: {b.peer} revealed a salt it had not committed to")
                    salts[b.peer] = got
            return set(salts) >= set(self.roster)

        for phase, ready, have in (("commitments", committed, commits), ("salts", revealed, salts)):
            await self.host.wait_for(ready, FORM_TIMEOUT_S, f"the draw's {phase} of island {self.name!r}")
            if missing := sorted(set(self.roster) - set(have)):
                raise ConfigError(f"island {self.name!r}: no draw {phase} from {missing} in {FORM_TIMEOUT_S:.0f} s")
            if phase == "commitments":
                self.salt = salt.hex()  # every member is bound now: reveal
                self.host.publish_soon()
        return island_order(self.roster, salts)

    def rank(self, peer: str) -> int:
        return self.roster.index(peer)

    def check(self, call: Call, lead: bool = True) -> None:
        """An island request from a member of ours (to its representative, when ``lead``)."""
        if not self.roster:
            raise ProtocolViolation(ErrorCode.NOT_READY, NOT_FORMED)
        if call.msg.fields.get("island") != self.name or call.remote not in self.roster:
            raise ProtocolViolation(ErrorCode.UNAUTHORIZED, f"not a member of island {self.name!r}")
        if lead and not self.leading:
            raise ProtocolViolation(ErrorCode.NOT_READY, "not the representative")

    # -- one step ------------------------------------------------------------------

    def _moment(self) -> dict[str, torch.Tensor] | None:
        opt = self.node.trainer.optimizer
        params = self.node.params()
        state = [opt.state.get(p) for p in params.values()]
        if not all(state):
            return None
        return {k: s["exp_avg"] for k, s in zip(params, state, strict=True)}

    def _grad_and_plan(self) -> tuple[float, ScapeMessage]:
        loss = self.node.trainer.compute_gradients()
        grads = {k: p.grad for k, p in self.node.params().items()}
        return loss, self.sync.plan(grads, self._moment())

    def _apply(self, synced: Synced) -> None:
        ghat = self.sync.apply(synced, self._moment())
        for k, p in self.node.params().items():
            p.grad.copy_(ghat[k].to(p.grad.device, p.grad.dtype).reshape(p.shape))
        if self.node.spec.outer.scape_hold:
            self.node.trainer.optimizer.hold_off(by_param(self.node.params().items(), self.sync.held()))
        self.node.trainer.apply_gradients()
        if self.host.opts.island_digest:
            h = hashlib.sha256()
            for p in self.node.params().values():
                h.update(p.detach().cpu().numpy().tobytes())
            self.digest = h.hexdigest()[:16]

    async def step(self) -> float:
        """One synchronized inner step; returns the own batch's loss."""
        msg: ScapeMessage | None = None
        busy = 0
        while True:
            if self.leading:
                await self.rep.serve_states()  # a step boundary: the state a follower takes is consistent
            if self.need_resync:
                await self._resync()
                msg = None
            t0 = time.perf_counter()
            sent0, got0 = self.stats["step_bytes_sent"], self.stats["step_bytes_received"]
            if msg is None:
                loss, msg = await self.host.compute(self._grad_and_plan)
            try:
                synced = await (self.rep.lead(msg) if self.leading else self._follow(msg))
            except MustResync as e:
                log.info("island %s: resync (%s)", self.name, e)
                self.need_resync = True
                continue
            except LeaderBusy as e:
                busy += 1
                if busy <= BUSY_RETRIES:
                    await asyncio.sleep(0.5)
                    continue
                await self._failover(str(e))
                if not self.leading:
                    self.need_resync = True
                continue
            except LeaderLost as e:
                await self._failover(str(e))
                if not self.leading:
                    self.need_resync = True
                continue
            await self.host.compute(self._apply, synced)
            self.stats["steps_synced"] += 1
            self.step_s = ema(self.step_s, time.perf_counter() - t0, keep=0.8)
            sent, got = self.stats["step_bytes_sent"], self.stats["step_bytes_received"]
            self.host.events.write(
                "island_step",
                step=synced.step,
                leader=self.leader,
                senders=len(synced.senders),
                values=synced.values.numel(),
                sent=sent - sent0,
                received=got - got0,
                dense=4 * self.sync.numel,
                **({"digest": self.digest} if self.host.opts.island_digest else {}),
            )
            return loss

    def deadline_s(self) -> float:
        """How long the representative waits for its followers' step messages."""
        net = self.node.spec.network
        return max(net.request_timeout_s, 4.0 * self.step_s)

    async def _request(self, mtype: str, round_idx: int, **fields: Any):  # noqa: ANN202 - a Link
        h = self.host
        try:
            link = await open_link(h.p2p, self.leader, h.rpc.handler_name(SERVICE), h.limits, "recv")
        except Unreachable as e:
            raise LeaderLost(f"representative unreachable: {e}") from None
        await link.write_header(envelope(h.run_id, mtype, round_idx, h.me, island=self.name, **fields))
        return link

    async def _follow(self, msg: ScapeMessage) -> Synced:
        vals = msg.values.float().contiguous()
        shard = encode_indices(msg.mask_shard) if msg.mask_shard is not None else b""
        nm = 0 if msg.mask_shard is None else msg.mask_shard.numel()
        extra = self.node.spec.network.max_wait_s  # a live representative answers; a dead one breaks the stream
        try:
            link = await self._request(
                "island.step",
                self.node.round,
                step=msg.step,
                nv=vals.numel(),
                nm=nm,
                has_mask=msg.mask_shard is not None,
            )
            try:
                await link.write_part(vals.numpy().tobytes())
                await link.write_part(shard)
                self.stats["step_bytes_sent"] += 4 * vals.numel() + len(shard)
                code, resp = await link.read_answer(extra_s=extra)
                if code == ErrorCode.STALE_ROUND:
                    raise MustResync(str(resp.get("msg", "")))
                if code != ErrorCode.OK:
                    raise busy_or_lost(code, resp)
                synced, n = await read_synced(link, resp, self.sync)
                self.stats["step_bytes_received"] += n
                return synced
            finally:
                link.writer.close()
        except (ConnectionError, TransferCut, asyncio.IncompleteReadError, ProtocolViolation, TimeoutError) as e:
            # A broken stream from a representative that is still live (fresh heartbeat) is retried: its step may
            # have gone on (then we resync); a dead one fails the next dial, and that fails over.
            kind = LeaderBusy if self._leader_alive() else LeaderLost
            raise kind(f"{type(e).__name__}: {e}") from None

    # -- outer rounds ---------------------------------------------------------------

    async def outer_point(self) -> None:
        """A follower, where the representative settles: fetch the round it planned and apply it."""
        if self.leading:
            return
        for r in sorted(self.sent):
            sent = self.sent.pop(r)
            try:
                link = await self._request("island.outer", r)
                try:
                    code, resp = await link.read_answer(extra_s=self.node.spec.network.max_wait_s)
                    if code == ErrorCode.NOT_READY and resp.get("msg") == NEVER_PLANNED:
                        continue  # nobody applies a round the dead representative planned
                    if code != ErrorCode.OK:
                        raise LeaderLost(f"round {r}: {code.name} {resp.get('msg', '')}")
                    want = {k: tuple(v.shape) for k, v in self.node.algo.state_dict().items()}
                    state, n = await read_tensors(link, resp, want)
                finally:
                    link.writer.close()
            except (LeaderLost, ConnectionError, TransferCut, asyncio.IncompleteReadError, ProtocolViolation) as e:
                log.info("island %s: round %d not applied (%s); resyncing", self.name, r, e)
                self.need_resync = True
                return
            self.stats["outer_bytes"] += n
            await self.host.compute(apply_outer, self.node, sent, state)
            self.stats["outer_applied"] += 1

    def round_end(self) -> None:
        """A follower, where the representative plans: keep theta_sent (the compute thread)."""
        if not self.leading:
            self.sent[self.node.round] = snapshot(self.node.params())

    # -- resync and failover ------------------------------------------------------------

    async def _resync(self) -> None:
        """Take the representative's state (retrying, failing over when it is gone)."""
        until = time.monotonic() + FORM_TIMEOUT_S
        while True:
            try:
                link = await self._request("island.state", self.node.round)
                try:
                    code, resp = await link.read_answer(extra_s=self.node.spec.network.max_wait_s)
                    if code != ErrorCode.OK:
                        raise busy_or_lost(code, resp)
                    got = await read_state(link, resp, state_header(self.node))
                finally:
                    link.writer.close()
            except LeaderBusy:  # alive and not ready (still forming, not leading yet): ask it again
                if time.monotonic() < until:
                    await asyncio.sleep(0.2)
                    continue
                await self._failover("not ready for too long")
                if self.leading:
                    self.need_resync = False
                    return
                until = time.monotonic() + FORM_TIMEOUT_S
                continue
            except (LeaderLost, ConnectionError, TransferCut, asyncio.IncompleteReadError, ProtocolViolation) as e:
                if not isinstance(e, LeaderLost) and self._leader_alive() and time.monotonic() < until:
                    await asyncio.sleep(0.5)  # a broken download from a live representative: ask again
                    continue
                await self._failover(str(e))
                if self.leading:
                    self.need_resync = False
                    return
                await asyncio.sleep(0.2)
                continue
            tensors, fields, mask, n = got
            self.sent = await self.host.compute(load_state, self.node, self.sync, tensors, fields, mask)
            self.stats["resync_bytes"] += n
            self.stats["resyncs"] += 1
            self.need_resync = False
            self.rep.inbox.clear()
            return

    def _leader_alive(self) -> bool:
        b = self.host.beats.get(self.leader)
        ttl = self.node.spec.network.heartbeat_ttl_s
        return b is not None and not b.finished and self.host.dht_now() - b.time < ttl

    async def _failover(self, why: str) -> None:
        old = self.leader
        if old is not None and old != self.host.me:
            self.dead.add(old)
        alive = set(self._live_members(await self.host.read_beats()))
        members = [p for p in self.order if p in alive]
        self.leader = members[0] if members else self.host.me
        if self.leader != old:
            self.stats["failovers"] += 1
            self.host.events.write("island_failover", name=self.name, old=old, leader=self.leader, why=why)
            log.info(
                "island %s: representative %s lost (%s); now %s", self.name, (old or "?")[-8:], why, self.leader[-8:]
            )
        if self.leading:
            self.rep.active = set()  # followers come back through island.state or their next step
            self.sent.clear()  # the rounds we snapshotted as a follower: nobody will settle them
            self.host.publish_soon()

    def planned_round(self, round_idx: int) -> None:
        """The representative planned ``round_idx`` (``Node._train``): its followers will ask for it."""
        self.rep.planned.add(round_idx)

    def settle_done(self, round_idx: int, applied: bool) -> None:
        """The representative settled ``round_idx`` (``Node._apply``, the compute thread): followers may fetch it."""
        self.rep.settle_done(round_idx, applied)

    def summary(self) -> dict[str, Any]:
        """The island's part of the peer's exit summary."""
        return {"name": self.name, "roster": self.roster, "leader": self.leader, "leading": self.leading, **self.stats}

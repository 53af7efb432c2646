"""State sync: live peers serve their last round's state; a joiner downloads it so that a liar cannot steer it.

A donor keeps a snapshot of its state at its last round boundary (model weights
and outer state, fp32) with a manifest: each tensor's name, shape, dtype and
sha256, and a hash over the whole manifest. :func:`fetch_state` is the joiner:

1. It asks every donor the caller names (up to ``MAX_DONORS``, say 5) for its
   manifest. Each one is checked against the joiner's *own* layout
   (:func:`expected_layout` of its model: the exact set of names, each shape,
   fp32) and its state hash is recomputed, before anything is allocated or
   downloaded; sizes always come from the joiner's model, never from a donor.
   A manifest that differs is a fault against its donor, who is dropped.
2. The joining round is the median of the rounds the valid donors declare
   (robust to a minority of liars); a donor more than 1 round from it is
   dropped, and is a fault when more than ``ROUND_FAULT_DISTANCE`` away.
3. ``majority``: if one state hash is held by a strict majority of the
   remaining donors, that state is downloaded, spread over its holders. This is
   DiLoCo's and SparseLoCo's case: every honest donor holds the same averaged
   state. (A plurality is not enough: under gossip every honest hash differs, so
   two colluding identities serving one state out of five would hold the most.)
4. ``median``: otherwise (NoLoCo, GASLoC: gossip leaves every honest peer with
   its own state, so honest hashes differ) the states of up to
   ``MEDIAN_DONORS`` remaining donors (every donor asked, 5 by default) are
   downloaded and the joiner takes their coordinate-wise median. While the liars
   are fewer than half of the states downloaded, every coordinate of the median
   lies within the honest donors' range, whatever the liars sent: 2 of 5.
5. Every downloaded tensor is checked: its byte size from the joiner's layout,
   its sha256 against the manifest, and finiteness. A bad tensor is a fault
   against its donor, who is dropped: its batch goes to another holder (majority;
   when every holder lied, the rule is applied again to the donors left) or the
   median is taken over the rest. With no valid state (or fewer than 2 under the
   median rule) the answer is None: the caller starts from its own weights (or
   asks again). The joiner never raises on what a donor sends.

6. ``judge`` (the caller's check of what it is about to train on): every state
   the rules would take, each donor's under the median rule, is scored on the
   joiner's own held-out batches before it counts. A state the judge refuses
   (:func:`loss_verdict`: its loss above ``STATE_LOSS_FACTOR`` times the loss the
   members publish, or above the joiner's own weights' loss once the members
   publish a lower one) is a fault against every donor that served it, and the
   rules run again on the donors left: a majority of colluders serving a state
   that trains worse is out-voted by the check, not by a count of identities.
   What it cannot see: a poisoned state whose loss on those batches is as good as
   an honest one's (a backdoor, a small push in one direction).

A donor that merely disagrees (a different hash at the right round) is not a
fault: honest gossip donors always do.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from hivemind.p2p import P2P

from locomm.peer.transport.rpc import Call, Limits, Link, Service, request
from locomm.protocol.messages import ErrorCode, ProtocolViolation
from locomm.protocol.state_messages import (
    MAX_NAMES_PER_REQUEST,
    state_fetch_header,
    state_manifest_header,
    validate_manifest,
    validate_state_fetch,
)

log = logging.getLogger(__name__)
FETCH_BATCH_BYTES = 32 << 20
FETCH_COPIES = 3
"""How many copies of the whole state one requester may fetch from us within FETCH_WINDOW_S: a joiner takes one
per attempt (a retry may take a second; the median rule takes one from each of several donors, not several from
one), so a requester past it is refused NOT_READY, not a fault, and our upload is not anyone's to spend."""
FETCH_WINDOW_S = 600.0
UNAUTHORIZED_RETRIES = 5
CONNECT_RETRIES = 1
"""Manifest requests asked again after a failure that is not the donor's answer (a stream that did not open)."""
MAX_DONORS = 8
"""Donors asked for a manifest, at most (the caller passes a few, say 5)."""
MEDIAN_DONORS = MAX_DONORS
"""States downloaded under the median rule, at most: every valid donor (the median is only as strong as the
number of states it is taken over: a minority of them cannot move it)."""
ROUND_FAULT_DISTANCE = 2
"""A donor whose round is further than this from the median is a fault (more than 1 away: only dropped)."""
STATE_LOSS_FACTOR = 3.0
"""A downloaded state whose loss on the joiner's held-out batches is above this many times the median loss the
members publish is refused. Generous on purpose: members publish their last round's training loss on their own
shard, lower than a held-out loss (far lower on non-IID shards); the rule is for states that do not train, not
for a close call."""
Layout = Mapping[str, tuple[int, ...]]
OnFault = Callable[[str, str], None]
Judge = Callable[[dict[str, torch.Tensor]], Awaitable[str | None]]
"""Scores a candidate state before it counts: None to take it, else why not (a fault against its donors)."""


def loss_verdict(loss: float, published: Sequence[float | None], own: float | None = None) -> str | None:
    """Whether a state whose loss on our held-out batches is ``loss`` may be trained on: None, or why not.

    ``published``: the losses the members' heartbeats carry (None and non-finite ones are ignored; the median
    is taken, so a minority cannot move the reference); ``own``: the loss of the weights we hold now (fresh
    ones for a new joiner). Refused: a non-finite loss; a loss above ``STATE_LOSS_FACTOR`` x the published
    median; a loss no lower than our own weights' once the members publish a lower one (the swarm has trained,
    and this state is no better than not syncing at all: the run's initial weights, which a fresh joiner holds
    too, score exactly its own loss). With nothing published, only the first two checks apply."""
    if not math.isfinite(loss):
        return f"loss on our held-out batches is {loss}"
    ref = [x for x in published if x is not None and math.isfinite(x)]
    if not ref:
        return None
    median = statistics.median(ref)
    if loss > STATE_LOSS_FACTOR * median:
        return f"loss on our held-out batches is {loss:.4g}, over {STATE_LOSS_FACTOR:g}x the members' {median:.4g}"
    if own is not None and math.isfinite(own) and median < own <= loss:  # a fresh model's weights: equal, no gain
        return f"loss on our held-out batches is {loss:.4g}, no better than our own weights' {own:.4g}"
    return None


class _Lied(Exception):
    """A donor's answer that our checks refuse (a fault against it), as opposed to its own refusal."""


class StateMismatch(ValueError):
    """A state whose names, shapes or values do not fit this peer's model (the caller keeps its own weights)."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _manifest_hash(manifest: list[dict[str, Any]]) -> str:
    return hashlib.sha256(repr([(m["name"], list(m["shape"]), m["sha256"]) for m in manifest]).encode()).hexdigest()


class Snapshot:
    """A copy of a peer's state at a round boundary. Its manifest (every tensor's sha256) is computed when a
    joiner first asks for it (:meth:`seal`, in a thread), not when it is taken: a peer takes one every round,
    on the thread that trains, and is asked for one in few rounds (hashing 56.8M parameters' state took
    seconds of every round on 2 cores)."""

    def __init__(self, round: int, tensors: dict[str, torch.Tensor]) -> None:  # noqa: A002 - the field's name
        self.round = round
        self.tensors = tensors  # fp32, CPU, contiguous
        self._manifest: list[dict[str, Any]] | None = None
        self._hash = ""
        self._lock = threading.Lock()

    @classmethod
    def take(cls, round_idx: int, tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        clean = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
        return cls(round_idx, clean)

    def seal(self) -> None:
        """Compute the manifest and the state hash, once (blocking: call it in a thread)."""
        with self._lock:
            if self._manifest is None:
                manifest = [
                    {"name": k, "shape": list(v.shape), "dtype": "float32", "sha256": _digest(v)}
                    for k, v in sorted(self.tensors.items())
                ]
                self._hash, self._manifest = _manifest_hash(manifest), manifest

    @property
    def manifest(self) -> list[dict[str, Any]]:
        self.seal()
        assert self._manifest is not None
        return self._manifest

    @property
    def state_hash(self) -> str:
        self.seal()
        return self._hash


class StateServer:
    """Answers manifest and fetch requests from the latest snapshot (a service on the RPC base).

    Its policy is ``announced``: a joiner downloads state before it is admitted, so any peer with a
    heartbeat in the swarm may ask; nobody else.
    """

    def __init__(self, run_id: str, clock: Callable[[], float] = time.monotonic, copies: int = FETCH_COPIES) -> None:
        self.run_id = run_id
        self.clock, self.copies = clock, copies
        self._current: Snapshot | None = None
        self._previous: Snapshot | None = None
        self._sent: dict[str, deque[tuple[float, int]]] = {}
        """Requester -> (when, bytes) of what we sent it within FETCH_WINDOW_S."""
        self.refused_budget = 0

    def _charge(self, requester: str, nbytes: int, state_bytes: int) -> None:
        """Count ``nbytes`` against the requester's budget (``copies`` states per FETCH_WINDOW_S), or refuse."""
        now = self.clock()
        for peer, q in list(self._sent.items()):  # every requester's history ends at the window: what we hold is
            while q and q[0][0] < now - FETCH_WINDOW_S:  # bounded by what we sent lately, not by who ever asked
                q.popleft()
            if not q:
                del self._sent[peer]
        sent = self._sent.get(requester, deque())
        if sum(n for _, n in sent) + nbytes > self.copies * state_bytes:
            self.refused_budget += 1
            wait = FETCH_WINDOW_S - (now - sent[0][0]) if sent else FETCH_WINDOW_S
            raise ProtocolViolation(
                ErrorCode.NOT_READY, f"{self.copies} copies of our state sent to you lately; ask again in {wait:.0f} s"
            )
        self._sent.setdefault(requester, sent).append((now, nbytes))

    @property
    def snapshot(self) -> Snapshot | None:
        """The newest snapshot: what a manifest request is answered with."""
        return self._current

    @snapshot.setter
    def snapshot(self, snap: Snapshot | None) -> None:
        # The one before stays fetchable: a joiner whose download spans a round boundary (a slow link, a
        # short round) finishes against the manifest it was given instead of starting over.
        self._previous, self._current = self._current, snap

    def _by_hash(self, state_hash: str) -> Snapshot | None:
        return next((s for s in (self._current, self._previous) if s is not None and s.state_hash == state_hash), None)

    def service(self) -> Service:
        return Service("state", {"state_manifest": self._manifest, "state_fetch": self._fetch}, policy="announced")

    async def _manifest(self, call: Call) -> None:
        snap = self.snapshot
        if snap is None:
            raise ProtocolViolation(ErrorCode.NOT_READY, "no state yet")
        await asyncio.to_thread(snap.seal)
        await call.answer(ErrorCode.OK, round=snap.round, state_hash=snap.state_hash, manifest=snap.manifest)

    async def _fetch(self, call: Call) -> None:
        snap = self.snapshot
        if snap is None:
            raise ProtocolViolation(ErrorCode.NOT_READY, "no state yet")
        names, state_hash = validate_state_fetch(call.msg, snap.tensors)
        for s in (self._current, self._previous):
            if s is not None:
                await asyncio.to_thread(s.seal)
        snap = self._by_hash(state_hash) or snap
        if state_hash != snap.state_hash:
            raise ProtocolViolation(ErrorCode.NOT_READY, "state moved on")
        body = [snap.tensors[n] for n in names]
        sizes = [t.numel() * 4 for t in body]
        self._charge(call.remote, sum(sizes), sum(t.numel() * 4 for t in snap.tensors.values()))
        await call.answer(ErrorCode.OK, sizes=sizes)
        call.link.meter.direction = "send"
        call.link.expect(sum(sizes) + 4 * len(sizes))
        for t in body:
            await call.link.write_part(memoryview(t.numpy()).cast("B"))


# ------------------------------------------------------------------------------ the joiner


@dataclass(frozen=True)
class Synced:
    """A downloaded state that passed every check."""

    round: int
    """The joining round: the median of the valid donors' declared rounds."""
    tensors: dict[str, torch.Tensor]
    """:func:`state_tensors`' layout, fp32, exactly the joiner's expected names and shapes."""
    donors: tuple[str, ...]
    """The donors whose tensors made the result."""
    rule: Literal["majority", "median"]
    """``majority``: one state most donors hold; ``median``: the coordinate-wise median of several."""
    faulted: tuple[str, ...]
    """Donors that sent something wrong (each reported to ``on_fault`` once)."""


@dataclass(frozen=True)
class _Offer:
    donor: str
    round: int
    state_hash: str
    sha256: dict[str, str]  # name -> digest, names exactly the expected ones


def expected_layout(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a state (``state_tensors`` of the joiner's own model): what every manifest must match."""
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _check_manifest(manifest: list[dict[str, Any]], state_hash: str, expected: Layout) -> dict[str, str]:
    """Name -> sha256 of a manifest that matches ``expected`` exactly; a ProtocolViolation otherwise."""
    got = {m["name"]: m for m in manifest}
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise ProtocolViolation(
            ErrorCode.UNEXPECTED_TENSOR, f"manifest names differ: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, shape in expected.items():
        if tuple(got[name]["shape"]) != tuple(shape) or got[name]["dtype"] != "float32":
            raise ProtocolViolation(
                ErrorCode.BAD_SHAPE, f"{name}: {got[name]['dtype']}{got[name]['shape']} is not float32{list(shape)}"
            )
    if _manifest_hash(sorted(manifest, key=lambda m: m["name"])) != state_hash:
        raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, "state hash does not match the manifest")
    return {n: m["sha256"] for n, m in got.items()}


def _batches(expected: Layout) -> list[list[str]]:
    """Names in fetch batches of up to FETCH_BATCH_BYTES (sized by the joiner's own layout)."""
    out: list[list[str]] = [[]]
    size = 0
    for name in sorted(expected):
        nbytes = 4 * math.prod(expected[name])
        if out[-1] and (size + nbytes > FETCH_BATCH_BYTES or len(out[-1]) >= MAX_NAMES_PER_REQUEST):
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return [b for b in out if b]


def _verify(names: list[str], parts: list[bytearray], offer: _Offer, expected: Layout) -> dict[str, torch.Tensor]:
    """The tensors of one fetched batch, each checked against the manifest's sha256 and for finiteness."""
    out = {}
    for name, data in zip(names, parts, strict=True):
        if hashlib.sha256(data).hexdigest() != offer.sha256[name]:
            raise _Lied(f"state tensor {name}: hash mismatch")
        t = torch.frombuffer(data, dtype=torch.float32).reshape(expected[name]) if data else torch.zeros(expected[name])
        if not bool(torch.isfinite(t).all()):
            raise _Lied(f"state tensor {name} is not finite")
        out[name] = t
    return out


def _median(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median (the mean of the middle two for an even count): within the middle values' range."""
    n = len(states)
    out = {}
    for name in states[0]:
        s = torch.stack([st[name] for st in states]).sort(dim=0).values  # (n, *shape)
        out[name] = s[(n - 1) // 2].clone() if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return out


def _majority(offers: list[_Offer]) -> str | None:
    """The state hash held by a strict majority of the donors, if one is."""
    counts = Counter(o.state_hash for o in offers).most_common(1)
    if counts and 2 * counts[0][1] > len(offers):
        return counts[0][0]
    return None


async def fetch_state(
    p2p: P2P,
    *,
    run_id: str,
    me: str,
    donors: list[str],
    limits: Limits,
    expected: Layout,
    on_fault: OnFault | None = None,
    judge: Judge | None = None,
) -> Synced | None:
    """Download a state that a minority of lying donors cannot steer (the module docstring has the rules).

    Args:
        p2p: our P2P instance.
        run_id: the run's id (the handler is ``locomm.{run_id}.state``).
        me: our peer id (the sender of every request).
        donors: the peers to ask (up to ``MAX_DONORS``; 5 is plenty).
        limits: the deadlines of every request and transfer.
        expected: name -> shape of the joiner's own state (:func:`expected_layout` of :func:`state_tensors`).
        on_fault: called ``(donor, reason)`` once per donor that sent something wrong.
        judge: the caller's check of a candidate state (rule 6 of the module docstring); None takes every state
            the rules pick.

    Returns:
        The state, or None when no valid state could be had (start from your own weights). Never raises on
        what a donor sends.
    """
    handler = f"locomm.{run_id}.state"
    faulted: list[str] = []

    def fault(donor: str, reason: str) -> None:
        log.warning("state donor %s: %s", donor[-8:], reason)
        if donor not in faulted:
            faulted.append(donor)
            if on_fault is not None:
                on_fault(donor, reason)

    async def ask(peer: str) -> _Offer | None:
        for attempt in range(UNAUTHORIZED_RETRIES + 1):
            try:
                resp, _ = await request(p2p, peer, handler, state_manifest_header(run_id, me), limits)
            except ProtocolViolation as v:
                # Our heartbeat may not have reached the donor's view of the DHT yet, or the request was slow to
                # arrive on a loaded machine (TIMEOUT): ask again shortly.
                retry = (ErrorCode.UNAUTHORIZED, ErrorCode.NOT_READY, ErrorCode.TIMEOUT)
                if v.code in retry and attempt < UNAUTHORIZED_RETRIES:
                    await asyncio.sleep(1.0 + attempt)
                    continue
                log.info("donor %s gave no manifest: %s", peer[-8:], v)  # its refusal: not a fault
                return None
            except (Exception, TimeoutError) as e:  # noqa: BLE001 - a donor that can't answer is skipped
                # A stream that failed to open (a loaded machine, a connection being replaced) is tried once
                # more; a donor that is gone costs one more dial, not the retries above.
                if attempt < min(CONNECT_RETRIES, UNAUTHORIZED_RETRIES):
                    log.info("donor %s gave no manifest (%s): asking once more", peer[-8:], e)
                    await asyncio.sleep(1.0)
                    continue
                log.info("donor %s gave no manifest: %s", peer[-8:], e)
                return None
            try:
                rnd, h, man = validate_manifest(resp)
                return _Offer(peer, rnd, h, _check_manifest(man, h, expected))
            except ProtocolViolation as v:
                fault(peer, f"manifest refused: {v}")
                return None
        return None

    asked = list(dict.fromkeys(d for d in donors if d != me))[:MAX_DONORS]
    offers = [o for o in await asyncio.gather(*(ask(d) for d in asked)) if o is not None]
    if not offers:
        return None
    joining = statistics.median_low(o.round for o in offers)
    for o in offers:
        if abs(o.round - joining) > ROUND_FAULT_DISTANCE:
            fault(o.donor, f"declares round {o.round}, the donors' median is {joining}")
    offers = [o for o in offers if abs(o.round - joining) <= 1]
    batches = _batches(expected)

    async def download(holders: list[_Offer]) -> tuple[dict[str, torch.Tensor], list[str]] | None:
        """One state from the holders of its hash, batches spread over them; None when they all failed."""
        got: dict[str, torch.Tensor] = {}
        used: list[str] = []
        alive = list(holders)
        todo = list(batches)
        while todo and alive:
            queue, failed = list(todo), []

            async def worker(offer: _Offer, queue: list[list[str]] = queue, failed: list[list[str]] = failed) -> None:
                while queue:
                    names = queue.pop()
                    try:
                        want = [4 * math.prod(expected[n]) for n in names]

                        async def read_body(
                            link: Link, resp: dict[str, Any], want: list[int] = want
                        ) -> list[bytearray]:
                            if resp.get("sizes") != want:
                                raise _Lied("answer sizes differ from the layout")
                            link.expect(sum(want) + 4 * len(want))
                            return [await link.read_part(n) for n in want]

                        header = state_fetch_header(run_id, me, names, offer.state_hash)
                        _, parts = await request(p2p, offer.donor, handler, header, limits, body=read_body)
                        got.update(await asyncio.to_thread(_verify, names, parts, offer, expected))
                        if offer.donor not in used:
                            used.append(offer.donor)
                    except _Lied as e:
                        fault(offer.donor, str(e))
                        failed.append(names)
                        alive.remove(offer)
                        return
                    except ProtocolViolation as v:  # the donor's refusal (its state moved on, say): not a fault
                        log.info("donor %s refused a fetch: %s", offer.donor[-8:], v)
                        failed.append(names)
                        alive.remove(offer)
                        return
                    except (Exception, TimeoutError) as e:  # noqa: BLE001 - drop this donor, give its batch back
                        log.warning("donor %s failed: %s", offer.donor[-8:], e)
                        failed.append(names)
                        alive.remove(offer)
                        return

            await asyncio.gather(*(worker(o) for o in list(alive)))
            todo = failed + queue
        if todo or set(got) != set(expected):
            return None
        return got, used

    async def refused(state: dict[str, torch.Tensor], donors: list[str]) -> bool:
        """The judge's verdict on one state; a refusal is a fault against each donor that served it."""
        if judge is None:
            return False
        try:
            why = await judge(state)
        except Exception as e:  # noqa: BLE001 - a state that breaks our forward pass is not one to train on
            why = f"evaluation failed: {type(e).__name__}: {e}"
        for d in donors if why else []:
            fault(d, f"served a state whose {why}")
        return why is not None

    while (top := _majority(offers)) is not None:
        holders = [o for o in offers if o.state_hash == top]
        res = await download(holders)
        if res is not None and await refused(res[0], [o.donor for o in holders]):
            offers = [o for o in offers if o.state_hash != top]
            continue
        if res is not None:
            return Synced(joining, res[0], tuple(res[1]), "majority", tuple(faulted))
        if not any(o.donor in faulted for o in holders):
            return None  # slow or moved on, not lying: ask again later rather than trust the rest
        offers = [o for o in offers if o.donor not in faulted]  # the liars are out: the rule again on the rest
    # The median rule: states of donors at the median round first.
    candidates = sorted(offers, key=lambda o: abs(o.round - joining))
    states: list[dict[str, torch.Tensor]] = []
    used: list[str] = []
    while len(states) < MEDIAN_DONORS and candidates:
        wave, candidates = candidates[: MEDIAN_DONORS - len(states)], candidates[MEDIAN_DONORS - len(states) :]
        for o, res in zip(wave, await asyncio.gather(*(download([o]) for o in wave)), strict=True):
            if res is not None and not await refused(res[0], [o.donor]):
                states.append(res[0])
                used.append(o.donor)
    if len(states) < 2:
        log.warning("state sync: %d valid state(s) under the median rule; need 2", len(states))
        return None
    tensors = await asyncio.to_thread(_median, states)
    return Synced(joining, tensors, tuple(used), "median", tuple(faulted))


def state_tensors(model: Mapping[str, torch.Tensor], algo: Any) -> dict[str, torch.Tensor]:
    """The tensors a state download carries: ``model/<name>`` weights and ``outer/<name>`` outer state."""
    return {
        **{f"model/{k}": v for k, v in model.items()},
        **{f"outer/{k}": v for k, v in algo.state_dict().items()},
    }


def load_state(tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], algo: Any) -> None:
    """Copy a downloaded state (:func:`state_tensors`' layout) into the live weights and the outer algorithm.

    Every name, shape and value is checked before anything is copied (no broadcasting, no partial load):
    a state that does not fit raises :class:`StateMismatch`, and the weights stay as they were.
    """
    want = expected_layout(state_tensors(params, algo))
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise StateMismatch(f"state names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise StateMismatch(f"{name}: shape {tuple(t.shape)}, this model has {shape}")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise StateMismatch(f"{name}: not finite floating point values")
    model = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    outer = {k[len("outer/") :]: v for k, v in tensors.items() if k.startswith("outer/")}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(model[k])
    algo.load_state_dict(outer)

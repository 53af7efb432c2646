"""State sync: live peers serve their last round's state; a joiner downloads it in verified chunks.

A donor keeps a snapshot of its state at its last round boundary (model weights
and outer state, fp32) with a manifest: each tensor's name, shape and sha256,
and a hash over the whole manifest. A joiner asks a few donors for manifests,
takes the newest state that the most donors hold (donors that hold the same
state hash are interchangeable), spreads the tensors over those donors, fetches
in parallel and checks every tensor against the manifest's hash. A donor that
fails or sends a wrong tensor is dropped and its share goes to another.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hivemind.p2p import P2P

from locomm.peer.rpc import Call, Limits, Link, Service, request
from locomm.protocol.messages import (
    MAX_NAMES_PER_REQUEST,
    ErrorCode,
    ProtocolViolation,
    state_fetch_header,
    state_manifest_header,
    validate_manifest,
    validate_state_fetch,
)

log = logging.getLogger(__name__)
FETCH_BATCH_BYTES = 32 << 20
UNAUTHORIZED_RETRIES = 5


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@dataclass
class Snapshot:
    round: int
    tensors: dict[str, torch.Tensor]  # fp32, CPU, contiguous
    manifest: list[dict[str, Any]]
    state_hash: str

    @classmethod
    def take(cls, round_idx: int, tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        clean = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
        manifest = [{"name": k, "shape": list(v.shape), "sha256": _digest(v)} for k, v in sorted(clean.items())]
        h = hashlib.sha256(repr([(m["name"], m["shape"], m["sha256"]) for m in manifest]).encode()).hexdigest()
        return cls(round=round_idx, tensors=clean, manifest=manifest, state_hash=h)


class StateServer:
    """Answers manifest and fetch requests from the latest snapshot (a service on the RPC base).

    Its policy is ``announced``: a joiner downloads state before it is admitted, so any peer with a
    heartbeat in the swarm may ask; nobody else.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._current: Snapshot | None = None
        self._previous: Snapshot | None = None

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
        await call.answer(ErrorCode.OK, round=snap.round, state_hash=snap.state_hash, manifest=snap.manifest)

    async def _fetch(self, call: Call) -> None:
        snap = self.snapshot
        if snap is None:
            raise ProtocolViolation(ErrorCode.NOT_READY, "no state yet")
        names, state_hash = validate_state_fetch(call.msg, snap.tensors)
        snap = self._by_hash(state_hash) or snap
        if state_hash != snap.state_hash:
            raise ProtocolViolation(ErrorCode.NOT_READY, "state moved on")
        body = [snap.tensors[n] for n in names]
        sizes = [t.numel() * 4 for t in body]
        await call.answer(ErrorCode.OK, sizes=sizes)
        call.link.meter.direction = "send"
        call.link.expect(sum(sizes) + 4 * len(sizes))
        for t in body:
            await call.link.write_part(memoryview(t.numpy()).cast("B"))


async def fetch_state(
    p2p: P2P, *, run_id: str, me: str, donors: list[str], limits: Limits, max_bytes: int, on_fault: Any = None
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """Download the newest state most donors agree on; None when no donor could give it."""
    handler = f"locomm.{run_id}.state"
    manifests: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    holders: dict[str, list[str]] = defaultdict(list)

    async def ask(peer: str) -> None:
        for attempt in range(UNAUTHORIZED_RETRIES + 1):
            try:
                resp, _ = await request(p2p, peer, handler, state_manifest_header(run_id, me), limits)
                rnd, h, man = validate_manifest(resp)
                manifests[h] = (rnd, man)
                holders[h].append(peer)
                return
            except ProtocolViolation as v:
                # Our heartbeat may not have reached the donor's view of the DHT yet: ask again shortly.
                if v.code in (ErrorCode.UNAUTHORIZED, ErrorCode.NOT_READY) and attempt < UNAUTHORIZED_RETRIES:
                    await asyncio.sleep(1.0 + attempt)
                    continue
                log.info("donor %s gave no manifest: %s", peer[-8:], v)
                return
            except (Exception, TimeoutError) as e:  # noqa: BLE001 - a donor that can't answer is skipped
                log.info("donor %s gave no manifest: %s", peer[-8:], e)
                return

    await asyncio.gather(*(ask(d) for d in donors))
    if not manifests:
        return None
    best = max(manifests, key=lambda h: (manifests[h][0], len(holders[h])))
    rnd, manifest = manifests[best]
    entries = {m["name"]: m for m in manifest}
    total = sum(4 * int(np.prod(m["shape"])) for m in entries.values())
    if total > max_bytes:
        log.warning("refusing a state of %d bytes (limit %d)", total, max_bytes)
        return None
    # Batches of names up to FETCH_BATCH_BYTES, spread over the donors holding this state.
    batches: list[list[str]] = [[]]
    size = 0
    for name, m in sorted(entries.items()):
        nbytes = 4 * int(np.prod(m["shape"]))
        if batches[-1] and (size + nbytes > FETCH_BATCH_BYTES or len(batches[-1]) >= MAX_NAMES_PER_REQUEST):
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += nbytes
    got: dict[str, torch.Tensor] = {}
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)

    async def read_body(names: list[str], link: Link, resp: dict[str, Any]) -> list[bytearray]:
        sizes = resp.get("sizes")
        want = [4 * int(np.prod(entries[n]["shape"])) for n in names]
        if sizes != want:
            raise ProtocolViolation(ErrorCode.BAD_SHAPE, "state answer sizes differ from the manifest")
        link.expect(sum(want) + 4 * len(want))
        return [await link.read_part(n) for n in want]

    async def worker(donor: str) -> None:
        while not queue.empty():
            names = queue.get_nowait()
            try:
                _, parts = await request(
                    p2p,
                    donor,
                    handler,
                    state_fetch_header(run_id, me, names, best),
                    limits,
                    body=lambda link, resp, names=names: read_body(names, link, resp),
                )
                for name, data in zip(names, parts):
                    m = entries[name]
                    if hashlib.sha256(data).hexdigest() != m["sha256"]:
                        if on_fault is not None:
                            on_fault(donor, f"state tensor {name}: hash mismatch")
                        raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"{name}: hash mismatch")
                    got[name] = torch.frombuffer(data, dtype=torch.float32).reshape(m["shape"])
            except (Exception, TimeoutError) as e:  # noqa: BLE001 - drop this donor, give its batch back
                log.warning("donor %s failed: %s", donor[-8:], e)
                queue.put_nowait(names)
                return

    await asyncio.gather(*(worker(d) for d in holders[best]))
    if set(got) != set(entries):
        return None
    return rnd, got


def state_tensors(model: Mapping[str, torch.Tensor], algo: Any) -> dict[str, torch.Tensor]:
    """The tensors a state download carries: ``model/<name>`` weights and ``outer/<name>`` outer state."""
    return {
        **{f"model/{k}": v for k, v in model.items()},
        **{f"outer/{k}": v for k, v in algo.state_dict().items()},
    }


def load_state(tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], algo: Any) -> None:
    """Copy a downloaded state (:func:`state_tensors`' layout) into the live weights and the outer algorithm."""
    model = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    outer = {k[len("outer/") :]: v for k, v in tensors.items() if k.startswith("outer/")}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(model[k])
    algo.load_state_dict(outer)

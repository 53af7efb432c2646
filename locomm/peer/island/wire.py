"""The island service's wire bytes (``peer/island/member.py``): the synchronized buffer, named fp32 tensors, a
state answer's fields; a closed island's membership proof; the draw of its representatives.

Every size is checked against what this member expects before anything is allocated: the values of a step
against its own mask (the members' masks are identical), a tensor against its own model's layout; a body that
does not fit is a ``ProtocolViolation``, never an exception inside the step loop.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import Any

import torch

from locomm.compression.base import CodecError
from locomm.peer.transport.records import SwarmKey
from locomm.peer.transport.rpc import Call, Link
from locomm.protocol.messages import ErrorCode, ProtocolViolation, response_header
from locomm.protocol.scape import ScapeSync, Synced, decode_indices, encode_indices

LEAVING = "the representative is leaving"
NEVER_PLANNED = "never planned here"
VARINT_MAX = 6
"""Bytes of one LEB128 gap at most (the ``scape`` codec's bound)."""


def island_proof(key: SwarmKey, run_id: str, name: str, peer: str) -> str:
    """What a member of a closed island puts in its heartbeat: an HMAC of (run, island, its own peer id); a
    copy is worth nothing to another peer id. A key that lists peer ids needs none."""
    return key.tag(_proof_message(run_id, name, peer)).hex()


def _proof_message(run_id: str, name: str, peer: str) -> bytes:
    return f"locomm-island:{run_id}:{name}:{peer}".encode()


SALT_BYTES = 32


def island_commitment(salt: bytes) -> str:
    """What a forming member publishes before its salt: a hash that binds it to the salt it will reveal."""
    return hashlib.sha256(b"locomm-island-commit:" + salt).hexdigest()


def island_order(roster: list[str], salts: dict[str, bytes]) -> list[str]:
    """The order in which the roster's members represent the island (the first one leads; a failover takes the
    next one alive): by a hash of every member's salt and the peer id.

    The salts were committed to (:func:`island_commitment`) before any was revealed, so no member, and no
    outsider grinding peer ids for a low one, can choose where it falls; it would need the others' salts before
    committing to its own. A member that withholds its salt stops the island forming (as a missing member
    does); it cannot pick the leader."""
    seed = hashlib.sha256(b"".join(salts[p] for p in sorted(roster))).digest()
    return sorted(roster, key=lambda p: hashlib.sha256(seed + p.encode()).digest())


def island_members(beats: Iterable[Any], name: str, key: SwarmKey | None, run_id: str) -> list[str]:
    """The peers whose heartbeats name island ``name`` (and, with ``key``, prove they hold it), sorted."""
    out = []
    for b in beats:
        if b.island != name:
            continue
        if key is not None:
            try:
                tag = bytes.fromhex(b.island_proof)
            except ValueError:
                continue
            if not key.admits(b.peer, _proof_message(run_id, name, b.peer), tag):
                continue
        out.append(b.peer)
    return sorted(out)


class LeaderLost(Exception):
    """The representative did not answer: fail over."""


class LeaderBusy(LeaderLost):
    """A live representative answered that it is not ready (still forming, not leading yet): retry it."""


def busy_or_lost(code: ErrorCode, resp: dict[str, Any]) -> LeaderLost:
    """What a non-OK answer of the representative means: it is leaving (fail over), or retry it."""
    msg = str(resp.get("msg", ""))
    if code == ErrorCode.NOT_READY and msg == LEAVING:
        return LeaderLost(msg)
    if code in (ErrorCode.NOT_READY, ErrorCode.INTERNAL, ErrorCode.TIMEOUT):
        return LeaderBusy(f"{code.name}: {msg}")
    return LeaderLost(f"answered {code.name}: {msg}")


class MustResync(Exception):
    """The representative is at another step, or went on without us: take its state."""


def _bad(msg: str) -> ProtocolViolation:
    return ProtocolViolation(ErrorCode.BAD_PAYLOAD, msg)


async def write_synced(call: Call, synced: Synced) -> int:
    """Answer an ``island.step`` with the step's buffer; returns the body bytes."""
    vals = synced.values.float().contiguous().numpy().tobytes()
    mask = encode_indices(synced.next_mask) if synced.next_mask is not None else b""
    nm = -1 if synced.next_mask is None else synced.next_mask.numel()
    call.answered = True
    await call.link.write_header(
        response_header(ErrorCode.OK, "", step=synced.step, senders=synced.senders, given=synced.shards_given, nm=nm)
    )
    await call.link.write_part(vals)
    await call.link.write_part(mask)
    return len(vals) + len(mask)


async def read_synced(link: Link, resp: dict[str, Any], sync: ScapeSync) -> tuple[Synced, int]:
    """The buffer the representative answered, checked against our own mask and step."""
    step, nm = resp.get("step"), resp.get("nm")
    senders, given = resp.get("senders"), resp.get("given")
    if step != sync.step or not isinstance(nm, int) or not -1 <= nm <= sync.numel:
        raise _bad(f"synced step {step!r} (we are at {sync.step}) with nm={nm!r}")
    if not (isinstance(senders, list) and isinstance(given, list)):
        raise _bad("synced senders/given missing")
    if not all(isinstance(r, int) and 0 <= r < sync.workers for r in senders + given):
        raise _bad("synced ranks out of range")
    nv = sync.numel if sync.mask is None else sync.mask.numel()
    raw = await link.read_part(4 * nv)
    if len(raw) != 4 * nv:
        raise _bad(f"synced buffer of {len(raw)} bytes, our mask has {nv} values")
    values = torch.frombuffer(raw, dtype=torch.float32).clone()
    if not bool(torch.isfinite(values).all()):
        raise ProtocolViolation(ErrorCode.NOT_FINITE, "synced buffer not finite")
    gaps = await link.read_part(VARINT_MAX * max(nm, 0))
    try:
        mask = decode_indices(gaps, nm, sync.numel) if nm >= 0 else None
    except CodecError as e:
        raise _bad(f"next mask: {e}") from None
    return Synced(step, values, list(senders), mask, list(given)), len(raw) + len(gaps)


async def write_tensors(
    call: Call, tensors: dict[str, torch.Tensor], *, fields: dict[str, Any] | None = None, tail: bytes = b""
) -> int:
    """Answer with named fp32 tensors (then ``tail``, a mask's gaps); returns the body bytes."""
    names = [[k, list(v.shape)] for k, v in tensors.items()]
    call.answered = True
    await call.link.write_header(response_header(ErrorCode.OK, "", tensors=names, ntail=len(tail), **(fields or {})))
    n = 0
    for v in tensors.values():
        data = v.detach().float().contiguous().cpu().numpy().tobytes()
        await call.link.write_part(data)
        n += len(data)
    await call.link.write_part(tail)
    return n + len(tail)


async def read_tensors(
    link: Link, resp: dict[str, Any], want: dict[str, tuple[int, ...]], optional: frozenset[str] = frozenset()
) -> tuple[dict[str, torch.Tensor], int]:
    """Named fp32 tensors: every name of ``want`` (those in ``optional`` may be absent), each of its shape."""
    listed = resp.get("tensors")
    if not isinstance(listed, list) or len(listed) > len(want):
        raise _bad("tensor list missing or too long")
    names: list[tuple[str, tuple[int, ...]]] = []
    for entry in listed:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise _bad("malformed tensor entry")
        dims = entry[1]
        ok_dims = isinstance(dims, list) and all(type(d) is int and d >= 0 for d in dims)
        name, shape = entry[0], tuple(dims) if ok_dims else None
        if name not in want or shape != want[name]:
            raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"{name}: {shape} is not in this model's layout")
        names.append((name, shape))
    missing = set(want) - {n for n, _ in names} - optional
    if missing:
        raise _bad(f"tensors missing: {sorted(missing)[:3]}")
    out, total = {}, 0
    for name, shape in names:
        nbytes = 4 * math.prod(shape)
        raw = await link.read_part(nbytes)
        if len(raw) != nbytes:
            raise _bad(f"{name}: {len(raw)} bytes, expected {nbytes}")
        t = torch.frombuffer(raw, dtype=torch.float32).clone().reshape(shape)
        if not bool(torch.isfinite(t).all()):
            raise ProtocolViolation(ErrorCode.NOT_FINITE, f"{name}: not finite")
        out[name] = t
        total += nbytes
    return out, total


async def read_state(
    link: Link, resp: dict[str, Any], layout: tuple[dict[str, tuple[int, ...]], frozenset[str]]
) -> tuple[dict[str, torch.Tensor], dict[str, Any], torch.Tensor | None, int]:
    """An ``island.state`` answer: tensors, the step fields, the current mask, bytes read."""
    want, optional = layout
    fields = {k: resp.get(k) for k in ("trainer_step", "sync_step", "round", "step_in_round", "sent_round", "nmask")}
    if not all(isinstance(v, int) and v >= -1 for v in fields.values()):
        raise _bad(f"state fields: {fields}")
    adam_step = resp.get("adam_step")
    if not isinstance(adam_step, int | float) or not 0 <= adam_step < 2**53:
        raise _bad("state adam_step")
    fields["adam_step"] = float(adam_step)
    tensors, n = await read_tensors(link, resp, want, optional)
    params = [k for k in want if k.startswith("model/")]
    has_adam = [f"adam/{k[6:]}" in tensors for k in params]
    if any(has_adam) and not all(has_adam):
        raise _bad("state carries AdamS moments for some parameters only")
    has_sent = [f"sent/{k[6:]}" in tensors for k in params]
    if (fields["sent_round"] >= 0) != all(has_sent) or (any(has_sent) and not all(has_sent)):
        raise _bad("state carries theta_sent partly, or without its round")
    nmask, ntail = fields["nmask"], resp.get("ntail")
    numel = sum(math.prod(want[k]) for k in params)
    if not isinstance(ntail, int) or not 0 <= ntail <= VARINT_MAX * max(nmask, 0) or nmask > numel:
        raise _bad("state mask size")
    tail = await link.read_part(ntail)
    try:
        mask = decode_indices(tail, nmask, numel) if nmask >= 0 else None
    except CodecError as e:
        raise _bad(f"state mask: {e}") from None
    return tensors, fields, mask, n + len(tail)

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
from hivemind.p2p import P2P, PeerID

from locomm import PROTOCOL_VERSION
from locomm.protocol.messages import ErrorCode, ProtocolViolation, check_response, response_header, validate_header
from locomm.peer.wire import read_exact, read_header, write_frame

log = logging.getLogger(__name__)
FETCH_BATCH_BYTES = 32 << 20
MAX_NAMES_PER_REQUEST = 4096


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@dataclass
class Snapshot:
    round: int
    tensors: dict[str, torch.Tensor]  # fp32, CPU, contiguous
    manifest: list[dict[str, Any]]
    state_hash: str

    @classmethod
    def take(cls, round_idx: int, tensors: Mapping[str, torch.Tensor]) -> "Snapshot":
        clean = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
        manifest = [{"name": k, "shape": list(v.shape), "sha256": _digest(v)} for k, v in sorted(clean.items())]
        h = hashlib.sha256(repr([(m["name"], m["shape"], m["sha256"]) for m in manifest]).encode()).hexdigest()
        return cls(round=round_idx, tensors=clean, manifest=manifest, state_hash=h)


class StateServer:
    """Answers manifest and fetch requests from the latest snapshot."""

    def __init__(self, p2p: P2P, run_id: str, timeout: float) -> None:
        self.p2p = p2p
        self.run_id = run_id
        self.timeout = timeout
        self.snapshot: Snapshot | None = None
        self.handler_name = f"locomm.{run_id}.state"

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._handle)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await read_header(reader, self.timeout)
            msg = validate_header(header, run_id=self.run_id, expected=None, max_body_bytes=0,
                                  types=("state_manifest", "state_fetch"))
            snap = self.snapshot
            if snap is None:
                raise ProtocolViolation(ErrorCode.NOT_READY, "no state yet")
            if msg.type == "state_manifest":
                await write_frame(writer, response_header(ErrorCode.OK, round=snap.round, state_hash=snap.state_hash,
                                                          manifest=snap.manifest))
                return
            names = msg.fields.get("names")
            if (not isinstance(names, list) or len(names) > MAX_NAMES_PER_REQUEST
                    or not all(isinstance(n, str) and n in snap.tensors for n in names)):
                raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, "unknown or too many tensor names")
            if msg.fields.get("state_hash") != snap.state_hash:
                raise ProtocolViolation(ErrorCode.NOT_READY, "state moved on")
            body = [snap.tensors[n].numpy().tobytes() for n in names]
            await write_frame(writer, response_header(ErrorCode.OK, sizes=[len(b) for b in body]), body)
        except ProtocolViolation as v:
            await _answer(writer, v.code, v.message)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let a request take the donor down
            log.exception("state handler failed")
            await _answer(writer, ErrorCode.INTERNAL, type(e).__name__)
        finally:
            writer.close()


async def _answer(writer: asyncio.StreamWriter, code: ErrorCode, msg: str) -> None:
    try:
        await write_frame(writer, response_header(code, msg))
    except Exception:  # noqa: BLE001 - the requester may be gone
        pass


async def _request(p2p: P2P, peer: str, handler: str, header: dict[str, Any], timeout: float,
                   read_body: bool = False) -> tuple[dict[str, Any], list[bytes]]:
    async with asyncio.timeout(timeout):
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
        try:
            await write_frame(writer, header)
            resp = await read_header(reader, timeout)
            code = check_response(resp)
            if code != ErrorCode.OK:
                raise ProtocolViolation(code, str(resp.get("msg", "")))
            parts: list[bytes] = []
            if read_body:
                sizes = resp.get("sizes")
                if not isinstance(sizes, list) or not all(isinstance(s, int) and 0 <= s <= 1 << 34 for s in sizes):
                    raise ProtocolViolation(ErrorCode.MALFORMED, "bad sizes in state response")
                for s in sizes:
                    parts.append(await read_exact(reader, s, timeout))
            return resp, parts
        finally:
            writer.close()


async def fetch_state(p2p: P2P, *, run_id: str, me: str, donors: list[str], timeout: float,
                      max_bytes: int) -> tuple[int, dict[str, torch.Tensor]] | None:
    """Download the newest state most donors agree on; None when no donor could give it."""
    handler = f"locomm.{run_id}.state"
    base = {"v": PROTOCOL_VERSION, "run": run_id, "round": 0, "sender": me}
    manifests: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    holders: dict[str, list[str]] = defaultdict(list)

    async def ask(peer: str) -> None:
        try:
            resp, _ = await _request(p2p, peer, handler, {**base, "type": "state_manifest"}, timeout)
            h, rnd, man = resp.get("state_hash"), resp.get("round"), resp.get("manifest")
            if isinstance(h, str) and isinstance(rnd, int) and isinstance(man, list):
                manifests[h] = (rnd, man)
                holders[h].append(peer)
        except (Exception, TimeoutError) as e:  # noqa: BLE001 - a donor that can't answer is skipped
            log.info("donor %s gave no manifest: %s", peer[-8:], e)

    await asyncio.gather(*(ask(d) for d in donors))
    if not manifests:
        return None
    best = max(manifests, key=lambda h: (manifests[h][0], len(holders[h])))
    rnd, manifest = manifests[best]
    entries = {m["name"]: m for m in manifest if isinstance(m, dict) and isinstance(m.get("name"), str)}
    total = sum(4 * int(np.prod(m.get("shape", [0]))) for m in entries.values())
    if total > max_bytes:
        log.warning("refusing a state of %d bytes (limit %d)", total, max_bytes)
        return None
    # Batches of names up to FETCH_BATCH_BYTES, spread round-robin over the donors holding this state.
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
    live = list(holders[best])
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)

    async def worker(donor: str) -> None:
        while not queue.empty():
            names = queue.get_nowait()
            try:
                _, parts = await _request(p2p, donor, handler,
                                          {**base, "type": "state_fetch", "names": names, "state_hash": best},
                                          timeout, read_body=True)
                if len(parts) != len(names):
                    raise ProtocolViolation(ErrorCode.MALFORMED, "wrong number of tensors")
                for name, data in zip(names, parts):
                    m = entries[name]
                    if len(data) != 4 * int(np.prod(m["shape"])) or hashlib.sha256(data).hexdigest() != m["sha256"]:
                        raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"{name}: hash mismatch")
                    got[name] = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).reshape(m["shape"])
            except (Exception, TimeoutError) as e:  # noqa: BLE001 - drop this donor, give its batch back
                log.warning("donor %s failed: %s", donor[-8:], e)
                queue.put_nowait(names)
                return

    await asyncio.gather(*(worker(d) for d in live))
    if set(got) != set(entries):
        return None
    return rnd, got

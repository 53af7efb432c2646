"""Fuzz live peers' handlers from many fresh identities, and measure the resource caps (issue 17 items 7, 8).

Starts two real swarms with ``locomm.testing.launcher`` (``locomm-peer join`` processes, nano preset,
training): a data-parallel pair ``a``, ``b`` (SparseLoCo, so a push carries top-k payloads) and a 2-stage
pipeline ``s0``, ``s1``. Then, from ``--identities`` fresh hivemind P2P identities per swarm (each its own
P2P instance and p2pd), sends ``--per-handler`` messages to each handler: push, pull, state_manifest,
state_fetch (on ``a``), stage fwd, stage eval (on ``s1``). Half of the identities publish a signed heartbeat
first (admitted but joining far in the future, so they pass the authorize hook and reach the handlers' body
parsing without entering anyone's groups; the stage ones as replicas of stage 0); the rest are strangers.

Each message is one stream carrying one mutation of a valid frame: random bytes, a truncation, bit flips,
a codec payload with bytes changed and its CRC re-sealed, huge declared sizes (header length, part
lengths, encoded sizes, a top-k shape of 2^28), a wrong run, version or round, or a sender that is not the
stream's peer id. On top, ``--slow`` streams per handler trickle a valid frame at 1 byte/s, and
``--concurrency`` streams are open at once. Reported per handler: messages sent, answers by code (or
``closed``: the peer ended the stream without an answer, ``no_answer``: none within 15 s), INTERNAL
answers and "handler failed" log lines (crashes), whether the peers still train, their peak RSS.

The two resource must-shows:
(a) a 4 MiB top-k part claiming 2^28 elements: decoded in a fresh process with and without the receiver's
    bound (peak RSS growth), and pushed at ``a`` over the wire (its VmHWM before and after);
(b) ``--flood-ids`` identities x ``--flood-streams`` streams of maximum declarations (a push of every
    part at the largest encoded size the plan allows, then held open) for ``--flood-s`` seconds: ``a``'s
    RSS growth against (partners + 2) payloads + 256 MiB, and whether ``a`` and ``b`` still exchange.

    python benchmarks/fuzz.py                       # ~15 min on 2 cores; benchmarks/results/fuzz.json
    python benchmarks/fuzz.py --quick               # 300 messages per handler, 16 x 4 flood
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import torch

from locomm import PROTOCOL_VERSION, __version__
from locomm.compression import get_codec
from locomm.compression.boundary import BoundaryCoder
from locomm.compression.payload import PayloadCodec
from locomm.config import RunSpec
from locomm.model.llama import build_model
from locomm.model.stages import Geometry
from locomm.protocol.membership import Heartbeat
from locomm.protocol.messages import (
    HEADER_LEN,
    PART_LEN,
    ErrorCode,
    activation_header,
    pack_frame,
    pull_header,
    push_header,
)
from locomm.protocol.state_messages import state_fetch_header, state_manifest_header
from locomm.testing.launcher import Launcher, PeerProcess

import _harness

HANDLERS = ("push", "pull", "state_manifest", "state_fetch", "stage_fwd", "stage_eval")
MUTATIONS = ("random", "truncate", "bitflip", "reseal", "huge", "wrong_field", "valid")
ANSWER_WAIT_S = 4.0
"""How long a sender waits for an answer (the peer's own deadlines cut a stream that stops earlier)."""
TRUNCATED_WAIT_S = 0.5
"""A truncated message's sender waits this long for an early refusal, then ends its stream."""


# ------------------------------------------------------------------------------ the swarms


def specs(tmp: Path) -> tuple[Path, Path, RunSpec, RunSpec]:
    net = dict(heartbeat_interval_s=1.0, heartbeat_ttl_s=15.0, request_timeout_s=10.0, stall_timeout_s=5.0)
    base = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=0.5, batch_size=4, seq_len=32)
        .replace("train", steps=10**6, eval_batches=1, eval_interval=0)
        .replace("network", **net)
    )
    dp = base.replace("outer", algo="sparseloco", inner_steps=10)
    pipe = base.replace("outer", algo="noloco", inner_steps=10).replace(
        "pipeline", stages=2, micro_batch_size=2, in_flight=1, stage_timeout_s=20.0
    )
    dp_path, pipe_path = tmp / "dp.toml", tmp / "pipe.toml"
    dp.save(dp_path)
    pipe.save(pipe_path)
    return dp_path, pipe_path, dp, pipe


def rss(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, bytes."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def peer_state(p: PeerProcess) -> dict[str, Any]:
    rounds, steps = p.events("round"), p.events("step")
    last = rounds[-1] if rounds else {}
    return {
        "alive": p.poll() is None,
        "round": p.round(),
        "rounds_logged": len(rounds),
        "answered_last": last.get("answered"),
        "faults": last.get("faults"),
        "steps": steps[-1]["step"] if steps else None,  # pipeline stage 0: its optimizer steps
        "lost": steps[-1].get("lost") if steps else None,
        **rss(p.pid),
    }


def progressed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Still training: alive, and its round (data-parallel) or its steps (pipeline stage 0) moved on."""
    moved = after["round"] > before["round"] or (after["steps"] or 0) > (before["steps"] or 0)
    return bool(after["alive"] and moved)


def handler_failures(p: PeerProcess) -> int:
    try:
        text = p.err.read_text(errors="replace") + p.out.read_text(errors="replace")
    except OSError:
        return 0
    return text.count("handler failed") + text.count("Traceback")


# ------------------------------------------------------------------------------ identities


_STARTS = asyncio.Semaphore(2)


class Ident:
    def __init__(self, p2p: Any, dht: Any, me: str, beat: Heartbeat | None) -> None:
        self.p2p, self.dht, self.me, self.beat = p2p, dht, me, beat


async def make_ident(folder: Path, name: str, boot: str, run_id: str, ttl: float, beat: dict | None) -> Ident:
    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P

    from locomm.peer.transport.records import SwarmValidator, load_identity

    path = folder / f"{name}.id"
    async with _STARTS:  # p2pd starts one or two at a time: many at once miss their startup timeout here
        p2p = await P2P.create(
            initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path), startup_timeout=60
        )
    me = p2p.peer_id.to_base58()
    dht = hb = None
    if beat is not None:
        validator = SwarmValidator(load_identity(path))
        validator.set_run(run_id, ttl)
        dht = await DHTNode.create(
            p2p=p2p,
            initial_peers=[boot],
            record_validator=validator,
            client_mode=True,
            ensure_bootstrap_success=False,  # a busy 2-core machine misses a ping now and then; stores retry
        )
        hb = Heartbeat(peer=me, version=__version__, started=True, **beat)
    return Ident(p2p, dht, me, hb)


async def keep_beating(idents: list[Ident], run_id: str, ttl: float, stop: asyncio.Event) -> None:
    from locomm.peer.transport.swarm import store_heartbeat

    while not stop.is_set():
        await asyncio.gather(
            *(store_heartbeat(i.dht, run_id, i.me, i.beat.record(), ttl) for i in idents if i.beat is not None),
            return_exceptions=True,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), ttl / 3)


async def shut(idents: list[Ident]) -> None:
    for i in idents:
        for node in (i.dht, i.p2p):
            if node is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(node.shutdown(), 10)


# ------------------------------------------------------------------------------ frames


class Frames:
    """Valid frames of each handler for one sender, and their mutations."""

    def __init__(self, dp: RunSpec, pipe: RunSpec, rng: random.Random) -> None:
        self.rng = rng
        self.dp_run, self.pipe_run = dp.hash()[:16], pipe.hash()[:16]
        model = build_model(dp.model)
        shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
        self.codec = PayloadCodec(shapes, {"sparse": "outer_gradient"}, dp.compression, encoded={"sparse": "topk2bit"})
        topk = get_codec("topk2bit", density=dp.outer.sparse_density, error_feedback=False)
        self.payload = {f"sparse/{k}": topk.encode(torch.randn(s)) for k, s in shapes.items()}
        self.enc = {k: len(v) for k, v in self.payload.items()}
        self.parts = self.codec.parts(self.enc)
        self.bodies = [self.codec.encode_part(self.payload, p) for p in self.parts]
        self.names = sorted(n for n, _ in model.named_parameters())
        geo = Geometry.of(pipe)
        self.coder = BoundaryCoder(pipe, geo)
        self.mbs, self.seq = pipe.pipeline.micro_batch_size, pipe.data.seq_len
        window = torch.randint(0, pipe.model.vocab_size, (self.mbs, self.seq + 1))
        self.window = self.coder.encode_window(window)
        self.act = self.coder.encode_activation(torch.randn(self.mbs, self.seq, geo.d), window[:, :-1])
        self.state_hash = "0" * 64

    def valid(self, handler: str, me: str, rnd: int) -> tuple[dict[str, Any], list[bytes]]:
        """(header, body parts) of a well-formed message."""
        r = self.rng
        if handler == "push":
            k = r.randrange(len(self.parts))
            idx = list(range(k, min(len(self.parts), k + r.randint(1, 3))))
            parts = [self.parts[i] for i in idx]
            head = push_header(self.dp_run, rnd, me, r.getrandbits(31), 0, 1, self.enc, parts)
            return head, [self.bodies[i] for i in idx]
        if handler == "pull":
            return pull_header(self.dp_run, rnd, me), []
        if handler == "state_manifest":
            return state_manifest_header(self.dp_run, me), []
        if handler == "state_fetch":
            names = r.sample(self.names, r.randint(1, 4))
            return state_fetch_header(self.dp_run, me, names, self.state_hash), []
        mtype = "fwd" if handler == "stage_fwd" else "eval"
        head = activation_header(
            self.pipe_run,
            me,
            mtype,
            step=rnd,
            stage=1,
            origin=me,
            mb=r.randrange(1 << 20),
            batch=self.mbs,
            seq=self.seq,
            codec=self.coder.act_stack,
            tokens_nbytes=len(self.window),
            act_nbytes=len(self.act),
        )
        return head, [self.window, self.act]

    @staticmethod
    def wire(head: dict[str, Any], parts: list[bytes]) -> bytes:
        return pack_frame(head) + b"".join(PART_LEN.pack(len(p)) + p for p in parts)

    def mutate(self, handler: str, me: str, rnd: int, kind: str) -> bytes:
        r = self.rng
        head, parts = self.valid(handler, me, rnd)
        if kind == "valid":
            return self.wire(head, parts)
        if kind == "random":
            return r.randbytes(r.choice((0, 1, 3, 4, 8, 64, 512, 4096)))
        if kind == "truncate":
            data = self.wire(head, parts)
            return data[: r.randrange(max(1, len(data)))]
        if kind == "bitflip":
            data = bytearray(self.wire(head, parts))
            for _ in range(r.randint(1, 8)):
                i = r.randrange(len(data))
                data[i] ^= 1 << r.randrange(8)
            return bytes(data)
        if kind == "reseal":  # change a codec payload's bytes, then fix its CRC so the decoder parses them
            if not parts or len(parts[-1]) < 12:
                return self.wire({**head, "round": r.randrange(-5, 5)}, parts)
            p = bytearray(parts[-1])
            for _ in range(r.randint(1, 4)):
                i = r.randrange(5, len(p) - 4)
                p[i] = r.randrange(256)
            p[-4:] = zlib.crc32(bytes(p[:-4])).to_bytes(4, "little")
            return self.wire(head, [*parts[:-1], bytes(p)])
        if kind == "huge":
            return self.huge(handler, head, parts)
        field = r.choice(("run", "v", "round", "sender", "type"))
        bad = {
            "run": "0123456789abcdef",
            "v": PROTOCOL_VERSION + 1,
            "round": r.choice((-1, 2**31, 2**62, rnd + 1000, rnd - 1000)),
            "sender": "QmNotTheStreamsPeer",
            "type": r.choice(("push", "pull", "fwd", "state_fetch", "nope")),
        }
        return self.wire({**head, field: bad[field]}, parts)

    def huge(self, handler: str, head: dict[str, Any], parts: list[bytes]) -> bytes:
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:  # a header length of 1 MiB + 1, or exactly 1 MiB of nothing useful
            return HEADER_LEN.pack(r.choice(((1 << 20) + 1, 1 << 20, 2**32 - 1))) + b"\0" * 64
        if kind == 1 and parts:  # a part length far past the declaration
            return pack_frame(head) + PART_LEN.pack(2**32 - 1) + parts[0][:64]
        if kind == 2 and handler == "push":  # encoded sizes at or past the plan's bound
            enc = {k: r.choice((2**40, self.codec.tensors[self.codec.index[k]].max_bytes() + 1)) for k in self.enc}
            return pack_frame({**head, "enc": enc}) + b"\0" * 64
        if kind == 3 and handler.startswith("stage"):
            tensors = [dict(t) for t in head["tensors"]]
            tensors[1]["nbytes"] = 2**40
            return pack_frame({**head, "tensors": tensors, "batch": 2**20})
        if handler == "push":  # a top-k part that claims 2^28 elements, sealed properly
            return self.wire(head, [topk_claiming(1 << 28, small=True)] + parts[1:])
        if handler == "state_fetch":
            return pack_frame({**head, "names": [f"x{i}" for i in range(100_000)]})
        return pack_frame({**head, "pad": "x" * r.randrange(1 << 19)})


def topk_claiming(numel: int, small: bool = False) -> bytes:
    """A sealed top-k payload claiming ``numel`` elements: the whole ceil(numel/64) bytes of values (4 MiB
    at 2^28), or (``small``) only 64 of them (still sealed: the shape is what a decoder meets first)."""
    from locomm.compression.base import Writer, dtype_code, seal
    from locomm.compression.topk2bit import TopK2BitCodec

    w = Writer()
    w.u8(dtype_code(torch.float32))
    w.shape((numel,))
    w.u8(1)
    w.f32(0.5)
    w.f32(1.0)
    w.raw(bytes(64 if small else -(-numel // 64)))
    body = Writer()
    body.blob(w.getvalue())
    body.u8(0)
    return seal(TopK2BitCodec.magic, body.getvalue())


# ------------------------------------------------------------------------------ sending


async def send(
    ident: Ident, peer: str, handler: str, data: bytes, *, slow: bool = False, wait_s: float = ANSWER_WAIT_S
) -> str:
    """One stream carrying ``data``; the answer's code name, or what happened instead."""
    from hivemind.p2p import PeerID

    try:
        _, reader, writer = await asyncio.wait_for(
            ident.p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler), 10
        )
    except Exception as e:  # noqa: BLE001
        return f"open_failed:{type(e).__name__}"
    try:
        if slow:
            for i in range(len(data)):
                writer.write(data[i : i + 1])
                await writer.drain()
                if reader.at_eof() or len(reader._buffer):  # answered (cut off): stop trickling
                    break
                await asyncio.sleep(1.0)
        else:  # no half-close: p2pd ends the whole stream on it, answer and all
            writer.write(data)
            await writer.drain()
        wait_s = 30.0 if slow else wait_s
        n = HEADER_LEN.unpack(await asyncio.wait_for(reader.readexactly(HEADER_LEN.size), wait_s))[0]
        resp = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(n), wait_s), raw=False)
        return ErrorCode(resp["status"]).name
    except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
        return "closed"
    except TimeoutError:
        return "no_answer"
    except Exception as e:  # noqa: BLE001
        return f"error:{type(e).__name__}"
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def fuzz_handler(
    handler: str, idents: list[Ident], target: PeerProcess, peer_id: str, frames: Frames, args: Any
) -> dict[str, Any]:
    run_id = frames.pipe_run if handler.startswith("stage") else frames.dp_run
    service = "stage" if handler.startswith("stage") else "gossip" if handler in ("push", "pull") else "state"
    name = f"locomm.{run_id}.{service}"
    rng = frames.rng
    answers: Counter[str] = Counter()
    by_mutation: dict[str, Counter[str]] = {m: Counter() for m in MUTATIONS}
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.monotonic()
    hwm0 = rss(target.pid).get("VmHWM", 0)

    async def one(i: int) -> None:
        ident = idents[i % len(idents)]
        kind = MUTATIONS[i % len(MUTATIONS)]
        rnd = target.round() + rng.randint(0, 1) if handler != "state_manifest" else 0
        data = frames.mutate(handler, ident.me, rnd, kind)
        async with sem:
            got = await send(
                ident, peer_id, name, data, wait_s=TRUNCATED_WAIT_S if kind == "truncate" else ANSWER_WAIT_S
            )
        answers[got] += 1
        by_mutation[kind][got] += 1

    slow = [
        asyncio.create_task(
            send(
                idents[k % len(idents)],
                peer_id,
                name,
                frames.mutate(handler, idents[k % len(idents)].me, target.round(), "valid"),
                slow=True,
            )
        )
        for k in range(args.slow)
    ]
    await asyncio.gather(*(one(i) for i in range(args.per_handler)))
    slow_answers = Counter(await asyncio.gather(*slow))
    return {
        "messages": args.per_handler + args.slow,
        "answers": dict(answers.most_common()),
        "by_mutation": {k: dict(v) for k, v in by_mutation.items()},
        "slow_streams": dict(slow_answers),
        "internal": answers.get("INTERNAL", 0),
        "wall_s": round(time.monotonic() - t0, 1),
        "target_hwm_growth_mib": round((rss(target.pid).get("VmHWM", 0) - hwm0) / 2**20, 1),
        "target": peer_state(target),
    }


# ------------------------------------------------------------------------------ must-shows


DECODE_RSS = """
import resource, sys, torch
sys.path.insert(0, {bench!r})
from fuzz import topk_claiming
from locomm.compression.topk2bit import TopK2BitCodec
data = topk_claiming(1 << 28)
c = TopK2BitCodec()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    c.decode(data, max_numel={bound})
    out = "decoded"
except Exception as e:
    out = type(e).__name__
print(out, len(data), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def topk_in_process() -> dict[str, Any]:
    """The 4 MiB / 2^28 top-k part decoded in a fresh process, with the receiver's bound and without it."""
    out = {}
    for label, bound in (("bounded", 1 << 16), ("unbounded", None)):
        code = DECODE_RSS.format(bench=str(_harness.HERE), bound=bound)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        outcome, size, grow = (res.stdout.split() + ["?", "0", "0"])[:3]
        out[label] = {
            "outcome": outcome,
            "payload_bytes": int(size),
            "peak_rss_growth_mib": round(int(grow) / 2**20, 1),
        }
    return out


async def topk_over_wire(ident: Ident, a: PeerProcess, a_id: str, frames: Frames) -> dict[str, Any]:
    """Pushes at ``a`` whose top-k part claims 2^28 elements: the 4 MiB one (its declared size is past the
    plan's bound) and a small one sized to fit the declaration (the decoder meets the claim)."""
    name = f"locomm.{frames.dp_run}.gossip"
    hwm0 = rss(a.pid).get("VmHWM", 0)
    res = Counter()
    big = topk_claiming(1 << 28)
    for k in range(20):
        head, parts = frames.valid("push", ident.me, a.round())
        first = frames.parts[0]
        name0 = frames.codec.tensors[first.tensor].name
        if k % 2 == 0:  # the 4 MiB part, declared as it is
            enc = {**frames.enc, name0: len(big)}
            pl = frames.codec.parts(enc)
            p0 = [p for p in pl if p.tensor == first.tensor]
            h = push_header(frames.dp_run, a.round(), ident.me, 1000 + k, 0, 1, enc, p0)
            data = Frames.wire(h, [big[p.start : p.start + p.count] for p in p0])
        else:  # a claim of 2^28 in the bytes the plan allows for this tensor
            small = topk_claiming(1 << 28, small=True)
            enc = {**frames.enc, name0: len(small)}
            p0 = [p for p in frames.codec.parts(enc) if p.tensor == first.tensor]
            h = push_header(frames.dp_run, a.round(), ident.me, 1000 + k, 0, 1, enc, p0)
            data = Frames.wire(h, [small])
        res[("declared_4MiB" if k % 2 == 0 else "fits_declaration") + ":" + await send(ident, a_id, name, data)] += 1
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    grow = rss(a.pid).get("VmHWM", 0) - hwm0
    return {"answers": dict(res), "peak_rss_growth_mib": round(grow / 2**20, 1), "under_16_mib": grow < 16 << 20}


async def flood(
    idents: list[Ident], a: PeerProcess, a_id: str, frames: Frames, streams: int, seconds: float
) -> dict[str, Any]:
    """``len(idents)`` x ``streams`` pushes of maximum declarations, held open, reopened when they end."""
    name = f"locomm.{frames.dp_run}.gossip"
    enc = {t.name: t.max_bytes() for t in frames.codec.tensors}
    parts = frames.codec.parts(enc)
    max_payload = sum(frames.codec.max_part_bytes(p) for p in parts)
    answers: Counter[str] = Counter()
    before = peer_state(a)
    rounds0 = before["rounds_logged"]
    peak = before.get("VmRSS", 0)
    end = time.monotonic() + seconds

    async def hold(ident: Ident) -> None:
        from hivemind.p2p import PeerID

        while time.monotonic() < end:
            head = push_header(frames.dp_run, a.round(), ident.me, random.getrandbits(31), 0, 1, enc, parts)
            try:
                _, reader, writer = await asyncio.wait_for(
                    ident.p2p.call_binary_stream_handler(PeerID.from_base58(a_id), name), 10
                )
            except Exception:  # noqa: BLE001
                answers["open_failed"] += 1
                await asyncio.sleep(0.5)
                continue
            try:
                writer.write(pack_frame(head) + PART_LEN.pack(frames.codec.max_part_bytes(parts[0])) + b"\1" * 4096)
                await writer.drain()
                n = HEADER_LEN.unpack(await asyncio.wait_for(reader.readexactly(4), end - time.monotonic() + 1))[0]
                resp = msgpack.unpackb(await reader.readexactly(n), raw=False)
                answers[ErrorCode(resp["status"]).name] += 1
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                answers["held_or_closed"] += 1
            except Exception as e:  # noqa: BLE001
                answers[type(e).__name__] += 1
            finally:
                writer.close()

    async def sample() -> None:
        nonlocal peak
        while time.monotonic() < end:
            peak = max(peak, rss(a.pid).get("VmRSS", 0))
            await asyncio.sleep(0.25)

    await asyncio.gather(sample(), *(hold(i) for i in idents for _ in range(streams)))
    await asyncio.sleep(5)
    after = peer_state(a)
    rounds = a.events("round")[rounds0:]
    partners = 1
    bound = (partners + 2) * max_payload + (256 << 20)
    growth = peak - before.get("VmRSS", 0)
    return {
        "identities": len(idents),
        "streams_each": streams,
        "seconds": seconds,
        "answers": dict(answers.most_common()),
        "max_payload_bytes": max_payload,
        "rss_before_mib": round(before.get("VmRSS", 0) / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_growth_mib": round(growth / 2**20, 1),
        "bound_mib": round(bound / 2**20, 1),
        "growth_under_bound": growth < bound,
        "rounds_during": [(r.get("round"), r.get("answered")) for r in rounds],
        "exchange_completed": any((r.get("answered") or 0) >= 1 for r in rounds),
        "after": after,
    }


# ------------------------------------------------------------------------------ main


async def run_all(args: Any, done: _harness.Entries, folder: Path) -> None:
    dp_path, pipe_path, dp, pipe = specs(folder)
    rng = random.Random(args.seed)
    frames = Frames(dp, pipe, rng)
    with Launcher(folder / "peers", threads=1) as launcher:
        # Started together (--wait-for-peers): nobody has trained when the second one joins, so neither
        # downloads state.
        wait = ("--wait-for-peers", "2", "-q")
        a = launcher.start("a", *wait, config=dp_path)
        b = launcher.start("b", *wait, config=dp_path, initial_peers=a.address())
        # Stage 1 first: it trains nothing until frames come, so stage 0 joins a swarm nobody has trained in yet.
        s1 = launcher.start("s1", "-q", "--stage", "1", config=pipe_path)
        s0 = launcher.start("s0", "-q", "--stage", "0", config=pipe_path, initial_peers=s1.address())
        peers = {"a": a, "b": b, "s0": s0, "s1": s1}
        ids = {k: p.events("started")[0]["peer"] if p.events("started") else None for k, p in peers.items()}
        deadline = time.monotonic() + 180
        while (a.round() < 2 or not s0.events("step")) and time.monotonic() < deadline:
            await asyncio.sleep(1)
        if not all(p.events("started") for p in peers.values()):
            raise RuntimeError("a peer did not start:\n" + "\n".join(f"{k}: {p.tail(600)}" for k, p in peers.items()))
        ids = {k: p.events("started")[0]["peer"] for k, p in peers.items()}
        start = {k: peer_state(p) for k, p in peers.items()}
        ttl = dp.network.heartbeat_ttl_s
        future = 10**6
        dp_beat = {"round": a.round(), "join_round": future}
        half = args.identities // 2
        dp_ids = await asyncio.gather(
            *(
                make_ident(
                    folder,
                    f"dp{i}",
                    a.address(),
                    frames.dp_run,
                    ttl,
                    dp_beat if i < half else None,
                )
                for i in range(args.identities)
            )
        )
        pipe_ids = await asyncio.gather(
            *(
                make_ident(
                    folder,
                    f"pp{i}",
                    s0.address(),
                    frames.pipe_run,
                    ttl,
                    {"round": 0, "join_round": future, "stage": 0} if i < half else None,
                )
                for i in range(args.identities)
            )
        )
        stop = asyncio.Event()
        beats = [
            asyncio.create_task(keep_beating(list(dp_ids), frames.dp_run, ttl, stop)),
            asyncio.create_task(keep_beating(list(pipe_ids), frames.pipe_run, ttl, stop)),
        ]
        await asyncio.sleep(3 * dp.network.heartbeat_interval_s)  # the targets read the new heartbeats
        try:
            for h in HANDLERS:
                if f"fuzz/{h}" in done:
                    continue
                target, tid, group = (s1, ids["s1"], pipe_ids) if h.startswith("stage") else (a, ids["a"], dp_ids)
                res = await fuzz_handler(h, list(group), target, tid, frames, args)
                res["handler_failed_lines"] = handler_failures(target)
                done.add(f"fuzz/{h}", res)
                print(h, json.dumps({k: res[k] for k in ("messages", "answers", "wall_s")}), flush=True)
            if "topk_2_28" not in done:
                # A fresh identity with a heartbeat (the fuzzing ones are banned by now).
                fresh = await make_ident(folder, "topk", a.address(), frames.dp_run, ttl, dp_beat)
                beats.append(asyncio.create_task(keep_beating([fresh], frames.dp_run, ttl, stop)))
                dp_ids = [*dp_ids, fresh]
                await asyncio.sleep(3 * dp.network.heartbeat_interval_s)
                wire = await topk_over_wire(fresh, a, ids["a"], frames)
                done.add("topk_2_28", {"in_process": topk_in_process(), "over_wire": wire})
                print("topk_2_28", json.dumps(done["topk_2_28"]), flush=True)
            if "flood" not in done:
                flooders = list(dp_ids[:half])
                extra = await asyncio.gather(
                    *(
                        make_ident(
                            folder,
                            f"fl{i}",
                            a.address(),
                            frames.dp_run,
                            ttl,
                            dp_beat,
                        )
                        for i in range(max(0, args.flood_ids - len(flooders)))
                    )
                )
                flooders += list(extra)
                beats.append(asyncio.create_task(keep_beating(list(extra), frames.dp_run, ttl, stop)))
                await asyncio.sleep(3 * dp.network.heartbeat_interval_s)
                res = await flood(flooders[: args.flood_ids], a, ids["a"], frames, args.flood_streams, args.flood_s)
                done.add("flood", res)
                print("flood", json.dumps({k: v for k, v in res.items() if k != "rounds_during"}), flush=True)
                dp_ids = [*dp_ids, *extra]
        finally:
            stop.set()
            await asyncio.gather(*beats, return_exceptions=True)
            end = {k: peer_state(p) for k, p in peers.items()}
            done.add(
                "peers",
                {
                    k: {
                        "start": start[k],
                        "end": end[k],
                        "still_training": progressed(start[k], end[k]),
                        "handler_failed_lines": handler_failures(p),
                        "peak_rss_mib": round(end[k].get("VmHWM", 0) / 2**20, 1),
                    }
                    for k, p in peers.items()
                },
            )
            await shut([*dp_ids, *pipe_ids])


def main() -> None:
    ap = _harness.parser(__doc__, out="fuzz.json", quick=True, resume=True)
    ap.add_argument("--identities", type=int, default=32, help="fresh identities per swarm (half publish a heartbeat)")
    ap.add_argument("--per-handler", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=128, help="streams open at once")
    ap.add_argument("--slow", type=int, default=8, help="1 byte/s streams per handler")
    ap.add_argument("--flood-ids", type=int, default=64)
    ap.add_argument("--flood-streams", type=int, default=16)
    ap.add_argument("--flood-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.per_handler, args.identities, args.flood_ids, args.flood_streams, args.flood_s = 300, 8, 16, 4, 20.0
    done = _harness.Entries(args.out, resume=args.resume, command=" ".join(["python", *sys.argv]))
    with tempfile.TemporaryDirectory(prefix="locomm-fuzz-") as tmp:
        t0 = time.monotonic()
        asyncio.run(run_all(args, done, Path(tmp)))
        if "wall_s" not in done:
            done.add("wall_s", round(time.monotonic() - t0, 1))
    print(f"wrote {done.save()}")
    os.sync()


if __name__ == "__main__":
    main()

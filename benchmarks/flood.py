"""A flood of finished payloads from admitted identities at one honest peer: its peak RSS against the budget.

Two real ``locomm-peer join`` peers train NoLoCo on loopback (the tiny preset: 6.5M parameters, a 26 MB payload).
Then ``--identities`` raw identities (each a P2P node and a DHT client, no training) publish signed heartbeats
as members (the swarm's current round, join round 0: backdated, so admission does not queue them) and push
complete, valid payloads (every part, the run's own codec encoding random weights, a fresh transfer id each)
to peer ``a`` for its current and next round, ``--streams`` at a time each, back to back, for ``--seconds``.
This is issue 32's measured attack (16 backdated identities pushed 32 finished 24.8 MB payloads to one peer, all
answered OK and kept decoded: +835 MB against a budget of 3 payloads). Measured: ``a``'s VmRSS every 0.25 s
(its peak during the flood against its peak over the same time before it), the answers by code (``reset``: the
stream was reset while the body was on its way, the refusal's answer lost with it), and whether
``a`` and ``b`` go on exchanging. The must-show: growth within (partners + 2) payloads + 256 MiB, where
partners is the most ``a`` had in a round during the flood.

    python benchmarks/flood.py                 # 16 identities x 2 streams, 60 s; benchmarks/results/flood.json
    python benchmarks/flood.py --quick         # 4 x 1, 20 s
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import torch
from fuzz import keep_beating, make_ident, rss, shut

from locomm.compression.payload import PayloadCodec
from locomm.config import RunSpec
from locomm.model.llama import build_model
from locomm.protocol import build_outer
from locomm.protocol.messages import HEADER_LEN, PART_LEN, ErrorCode, pack_frame, push_header
from locomm.testing.launcher import Launcher, PeerProcess

import _harness


def spec_file(folder: Path) -> tuple[Path, RunSpec]:
    spec = (
        RunSpec.preset("tiny")
        .replace("data", max_corpus_mb=1.0, batch_size=2, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=4)
        .replace("train", steps=1_000_000, eval_batches=1, eval_interval=0)
        .replace("network", heartbeat_interval_s=1.0, heartbeat_ttl_s=6.0)
    )
    path = folder / "run.toml"
    spec.save(path)
    return path, spec


class Payload:
    """One complete push of the run's payload, as a peer would send it: header, then every part."""

    def __init__(self, spec: RunSpec) -> None:
        params = dict(build_model(spec.model).named_parameters())
        algo = build_outer(spec.outer, params, 0)
        self.codec = PayloadCodec(
            {k: tuple(p.shape) for k, p in params.items()},
            algo.payload_roles,
            spec.compression,
            encoded=algo.payload_encoded,
        )
        if any(t.encoded for t in self.codec.tensors):
            raise SystemExit("flood.py sends a dense payload (NoLoCo): the spec's algorithm encodes its own")
        payload = {t.name: torch.randn(t.shape) for t in self.codec.tensors}
        self.parts = self.codec.parts({})
        bodies = [self.codec.encode_part(payload, p) for p in self.parts]
        self.body = b"".join(PART_LEN.pack(len(b)) + b for b in bodies)
        self.run_id = spec.hash()[:16]

    def frame(self, round_idx: int, me: str) -> bytes:
        head = push_header(self.run_id, round_idx, me, random.getrandbits(31), 0, 1, {}, self.parts)
        return pack_frame(head) + self.body


async def push_loop(ident: Any, a: PeerProcess, a_id: str, pl: Payload, end: float, answers: Counter) -> None:
    from hivemind.p2p import PeerID  # noqa: PLC0415

    handler = f"locomm.{pl.run_id}.gossip"
    k = 0
    while time.monotonic() < end:
        rnd = max(0, a.round() - 1) + k % 2  # a's round counter is one ahead of the round it exchanges
        k += 1
        try:
            _, reader, writer = await asyncio.wait_for(
                ident.p2p.call_binary_stream_handler(PeerID.from_base58(a_id), handler), 10
            )
        except Exception:  # noqa: BLE001 - p2pd busy, or refused at the dial
            answers["open_failed"] += 1
            await asyncio.sleep(0.5)
            continue

        async def answer(timeout: float) -> None:
            n = HEADER_LEN.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))[0]
            resp = msgpack.unpackb(await reader.readexactly(n), raw=False)
            answers[ErrorCode(resp["status"]).name] += 1

        try:
            try:
                writer.write(pl.frame(rnd, ident.me))
                await writer.drain()
            except ConnectionError:  # a refusal answers after the header and closes: read it
                await answer(2.0)
                continue
            await answer(max(1.0, end - time.monotonic() + 5))
        except ConnectionError:  # refused before the body: the stream reset took the answer with it
            answers["reset"] += 1
        except (TimeoutError, asyncio.IncompleteReadError):
            answers["no_answer"] += 1
        except Exception as e:  # noqa: BLE001
            answers[type(e).__name__] += 1
        finally:
            writer.close()
        await asyncio.sleep(0.05)


async def sample_peak(pid: int, seconds: float) -> int:
    peak, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, rss(pid).get("VmRSS", 0))
        await asyncio.sleep(0.25)
    return peak


async def run(args: Any, folder: Path) -> dict[str, Any]:
    cfg, spec = spec_file(folder)
    pl = Payload(spec)
    payload_bytes = len(pl.body)
    out: dict[str, Any] = {"bench": "flood", "payload_bytes": payload_bytes, "identities": args.identities}
    out["streams_each"], out["seconds"] = args.streams, args.seconds
    with Launcher(folder / "peers", grace_s=15.0) as launcher:
        a = launcher.start("a", "--wait-for-peers", "2", "--shard", "0/2", config=cfg)
        b = launcher.start("b", "--wait-for-peers", "2", "--shard", "1/2", config=cfg, initial_peers=a.address())
        deadline = time.monotonic() + 300
        while min(a.round(), b.round()) < 3:
            if time.monotonic() > deadline or a.poll() is not None or b.poll() is not None:
                raise RuntimeError(f"the honest pair did not train:\n{a.tail(800)}\n{b.tail(800)}")
            await asyncio.sleep(1)
        a_id = a.address().rsplit("/p2p/", 1)[1]
        ttl = spec.network.heartbeat_ttl_s
        idents = await asyncio.gather(
            *(
                make_ident(folder, f"fl{i}", a.address(), pl.run_id, ttl, {"round": a.round(), "join_round": 0})
                for i in range(args.identities)
            )
        )
        stop = asyncio.Event()
        beats = asyncio.create_task(keep_beating(list(idents), pl.run_id, ttl, stop))
        try:
            r0 = len(a.events("round"))
            out["rss_peak_before_mib"] = round(await sample_peak(a.proc.pid, args.seconds) / 2**20, 1)
            r1 = len(a.events("round"))
            answers: Counter[str] = Counter()
            end = time.monotonic() + args.seconds
            flood = [push_loop(i, a, a_id, pl, end, answers) for i in idents for _ in range(args.streams)]
            peak, *_ = await asyncio.gather(sample_peak(a.proc.pid, args.seconds), *flood)
            r2 = len(a.events("round"))
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await beats
            await shut(list(idents))
        during = a.events("round")[r1:r2]
        partners = max([len(e.get("partners") or []) for e in during] or [1])
        out["rss_peak_during_mib"] = round(peak / 2**20, 1)
        out["growth_mib"] = round(out["rss_peak_during_mib"] - out["rss_peak_before_mib"], 1)
        out["partners_max"] = partners
        out["bound_mib"] = round(((partners + 2) * payload_bytes + (256 << 20)) / 2**20, 1)
        out["within_bound"] = out["growth_mib"] <= out["bound_mib"]
        out["answers"] = dict(answers.most_common())
        out["rounds_before"], out["rounds_during"] = r1 - r0, r2 - r1
        out["answered_during"] = [e.get("answered") for e in during]
        out["members_during"] = sorted({e.get("members") for e in during if e.get("members") is not None})
        out["a_alive"], out["b_alive"] = a.poll() is None, b.poll() is None
    return out


def main() -> int:
    ap = _harness.parser(__doc__, out="flood.json", quick=True)
    ap.add_argument("--identities", type=int, default=16)
    ap.add_argument("--streams", type=int, default=2, help="Pushes in flight per identity")
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    if args.quick:
        args.identities, args.streams, args.seconds = 4, 1, 20.0
    with tempfile.TemporaryDirectory(prefix="locomm-flood-") as tmp:
        res = asyncio.run(run(args, Path(tmp)))
    res["command"] = " ".join(["python", *sys.argv])
    _harness.write_json(args.out, res)
    print(
        f"payload {res['payload_bytes'] / 1e6:.1f} MB; a's peak RSS {res['rss_peak_before_mib']} MiB before, "
        f"{res['rss_peak_during_mib']} MiB during the flood (+{res['growth_mib']} MiB, bound {res['bound_mib']} MiB "
        f"with {res['partners_max']} partners); answers {res['answers']}; rounds {res['rounds_before']} before, "
        f"{res['rounds_during']} during; answered {res['answered_during']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

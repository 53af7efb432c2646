"""Swarm tests: real `locomm-peer join` processes over hivemind's p2pd and DHT on loopback.

Every peer binds port 0 on 127.0.0.1 and the test reads the real address back from
the peer's announce file. Peers come from one launcher (locomm/testing/launcher.py, the
``launcher`` fixture of conftest.py); each runs in its own process group, which is stopped
at the end (SIGTERM, then SIGKILL to the group), so no p2pd outlives a test.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from locomm.config import RunSpec
from locomm.data import load_corpus
from locomm.sim import Simulator
from locomm.testing.launcher import Launcher, PeerProcess, wait_until
from locomm.testing.procs import Proc, alive, cmdline, descendants
from locomm.train import Trainer

pytestmark = pytest.mark.timeout(420)


def swarm_spec(tmp: Path, max_faults: int = 3, parameter_codec: str = "lossless", **outer) -> Path:
    spec = (
        RunSpec.preset("nano")
        .replace("compression", parameter=parameter_codec)
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=outer.pop("inner_steps", 10), **outer)
        .replace("train", steps=400, eval_batches=2, eval_interval=0)
        .replace(
            "network",
            request_timeout_s=6.0,
            stall_timeout_s=3.0,
            heartbeat_interval_s=1.0,
            heartbeat_ttl_s=4.0,
            max_faults_before_ban=max_faults,
        )
    )
    path = tmp / "run.toml"
    spec.save(path)
    return path


def join(peers: Launcher, name: str, config: Path, *args: str, initial: str | None = None) -> PeerProcess:
    """`locomm-peer join` on cpu with a log, an announce file and final weights, in ``peers``' folder."""
    return peers.start(name, *args, config=config, initial_peers=initial, weights=True)


Peer = PeerProcess  # what run_pair returns: .weights, .events(), .round(), .tail()


def run_pair(tmp_path: Path, cfg: Path, *args: str, launcher: Launcher | None = None) -> list[PeerProcess]:
    """Two peers (shards 0/2 and 1/2, b joining a) run to the end; both exit 0, and are cleaned up.

    With ``launcher`` (the fixture) the peers are its own and stopped at teardown; else a launcher
    into ``tmp_path`` stops them before this returns.
    """
    peers = launcher if launcher is not None else Launcher(tmp_path)
    pair: list[PeerProcess] = []
    try:
        pair.append(join(peers, "a", cfg, *args, "--shard", "0/2"))
        pair.append(join(peers, "b", cfg, *args, "--shard", "1/2", initial=pair[0].address()))
        for p in pair:
            assert p.wait(timeout=240) == 0, p.tail()
    finally:
        if launcher is None:
            peers.close()
    return pair


def flat(path: Path) -> torch.Tensor:
    w = load_file(str(path))
    return torch.cat([w[k].flatten() for k in sorted(w)])


def test_three_peers_join_and_kill(tmp_path, launcher):
    """3 peers train; a 4th joins mid-run and syncs state; one is SIGKILLed; the rest finish."""
    # Rounds of 30 steps (~0.6 s idle): at 10 (0.3 s) a joiner started beside a CPU hog came up after ~30 s, when
    # the swarm was at round 57 of 60, and every state download it tried was overtaken by the donors' rounds.
    # The joiner launched at round 3 starts training at round 25 idle and 21-24 beside a CPU hog: of 30 rounds,
    # in one suite run it started after the swarm had ended (0 exchanges). 45 rounds leave 20 to spare.
    rounds = 45
    cfg = swarm_spec(tmp_path, inner_steps=30)
    end = "--until-round", str(rounds)
    peers: list[PeerProcess] = []
    try:
        peers.append(join(launcher, "p0", cfg, *end, "--wait-for-peers", "3", "--shard", "0/4"))
        boot = peers[0].address()
        peers += [
            join(launcher, f"p{i}", cfg, *end, "--wait-for-peers", "3", "--shard", f"{i}/4", initial=boot)
            for i in (1, 2)
        ]
        wait_until(lambda: min(p.round() for p in peers) >= 3, 180, "3 peers reach round 3", peers)
        joiner = join(launcher, "p3", cfg, *end, "--shard", "3/4", initial=boot)
        peers.append(joiner)
        wait_until(
            lambda: (
                joiner.events("synced")
                and joiner.events("started")
                and joiner.round() >= joiner.events("started")[0]["round"] + 1
            ),
            120,
            "the joiner syncs and trains a round",
            peers,
        )
        peers[1].kill()  # the peer process only; its p2pd is orphaned
        survivors = [peers[0], peers[2], joiner]
        for p in survivors:
            assert p.wait(timeout=240) == 0, p.tail()
    finally:
        launcher.close()  # every peer's group, the orphaned p2pd too (the fixture would, at teardown)

    synced = joiner.events("synced")[0]
    assert synced["donor_round"] >= 3 and joiner.events("started")[0]["round"] >= synced["donor_round"]
    for p in survivors:
        fin = p.events("finished")[0]
        assert fin["rounds_completed"] == rounds
        assert fin["exchanges_ok"] > 0
    for p in (peers[0], peers[2]):
        fin = p.events("finished")[0]
        assert fin["final_loss"] < fin["initial_loss"] - 1.0
    # The joiner started from the swarm's state, not from scratch: its first evaluation is already low.
    joined = joiner.events("finished")[0]
    assert joined["initial_loss"] < peers[0].events("finished")[0]["initial_loss"] - 1.0
    assert joined["final_loss"] < joined["initial_loss"] + 0.05

    # Gossip pulls peers together: far closer than two workers trained alone on their shards, even alone for a
    # ninth of the run's steps (measured: alone they drift apart monotonically, 30.5 after 150 steps, 53.0 after
    # the run's 1350, against 0.007 between the survivors; the full 1350 cost the suite 23 s).
    dist = max(float((flat(a.weights) - flat(b.weights)).norm()) for a in survivors for b in survivors if a is not b)
    spec = RunSpec.load(cfg)
    splits = load_corpus(spec.data)
    alone = [Trainer(spec, splits=splits, worker_id=i, num_workers=4) for i in (0, 2)]
    for t in alone:
        for _ in range(rounds * spec.outer.inner_steps // 9):
            t.train_step()
    apart = float(
        (
            torch.cat([p.detach().flatten() for _, p in sorted(alone[0].model.named_parameters())])
            - torch.cat([p.detach().flatten() for _, p in sorted(alone[1].model.named_parameters())])
        ).norm()
    )
    assert dist < 0.5 * apart, (dist, apart)


@pytest.mark.parametrize("codec", ["lossless", "bf16+lossless"])
def test_two_peer_noloco_matches_simulator(tmp_path, launcher, codec):
    """Deterministic 2-peer NoLoCo over the network gives the simulator's weights, and counts its bytes.

    NoLoCo sends theta alone (gamma == alpha); with bf16+lossless both transports round the partner's
    theta to bf16 the same way, because both go through the one PayloadCodec.
    """
    cfg = swarm_spec(tmp_path, inner_steps=5, parameter_codec=codec)
    rounds = 3
    spec = RunSpec.load(cfg)
    args = ("--until-round", str(rounds), "--no-overlap", "--wait-for-peers", "2")
    peers = run_pair(tmp_path, cfg, *args, launcher=launcher)
    for p in peers:
        assert all(e["answered"] == 1 for e in p.events("round")), p.events("round")
    sim = Simulator(spec, 2, overlap=False)  # the daemon ran with --no-overlap
    res = sim.run(rounds)
    for w, (p, algo) in enumerate(zip(peers, sim.algos)):
        net = load_file(str(p.weights))
        # With bf16, a last-bit difference in fp32 training can flip a partner weight's bf16 rounding: at most
        # one bf16 step (2^-8 relative) times alpha/2 per round. Lossless is exact up to float reassociation.
        atol, rtol = (1e-5, 1e-4) if codec == "lossless" else (1e-4, 3 * 0.7 * 2**-8)
        for k, v in algo.phi.items():
            assert torch.allclose(net[k], v, atol=atol, rtol=rtol), (k, float((net[k] - v).abs().max()))
        # The same bytes: the daemon's lossless coding of the same weights is the simulator's.
        fin = p.events("finished")[0]
        # (A push refused while the partner's view of the DHT lacked us is retried; its bytes are not counted.)
        delivered = fin["bytes_sent"] - fin["bytes_undelivered"]
        assert delivered == pytest.approx(res.bytes_sent[w], rel=0.01), (fin, res.bytes_sent)


def test_malformed_messages_get_error_codes(tmp_path, launcher):
    """Garbage, wrong versions, oversized and non-finite payloads are answered with codes; the peer trains on."""
    import asyncio

    import msgpack
    from hivemind.p2p import P2P, PeerID

    from locomm import PROTOCOL_VERSION
    from locomm.protocol.messages import ErrorCode

    cfg = swarm_spec(tmp_path, max_faults=9, inner_steps=50)  # rounds of a second or so: see push() below
    spec = RunSpec.load(cfg)
    peer = join(launcher, "target", cfg, "--until-round", "100000", "--checkpoint-dir", str(tmp_path / "ck"))
    try:
        boot = peer.address()
        wait_until(lambda: peer.events("started"), 60, "peer starts", [peer])
        started = peer.events("started")[0]
        run, target = started["run"], started["peer"]
        handler = f"locomm.{run}.gossip"
        wait_until(lambda: peer.round() >= 1, 60, "a round", [peer])
        status = subprocess.run(
            [sys.executable, "-m", "locomm.cli.main", "status", "--initial-peers", boot, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr[-2000:]
        view = json.loads(status.stdout.strip().splitlines()[-1])
        assert view["run"] == run and [p["peer"] for p in view["peers"]] == [target]
        assert view["peers"][0]["round"] >= 1 and view["peers"][0]["loss"] is not None
        assert view["peers"][0]["answers"] and view["peers"][0]["state"] == "training"  # it answered a hello
        from locomm.model import build_model

        shapes = {n: tuple(p.shape) for n, p in build_model(spec.model).named_parameters()}

        async def probe() -> dict[str, int]:
            from hivemind.dht import DHTNode

            from locomm.compression.payload import PayloadCodec
            from locomm.peer.transport.records import SwarmValidator
            from locomm.peer.transport.swarm import store_heartbeat
            from locomm.protocol.messages import push_header, response_header

            ident = str(tmp_path / "probe.id")  # records are signed: the probe holds its identity's key
            client = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=ident)
            dht = await DHTNode.create(
                p2p=client, initial_peers=[boot], record_validator=SwarmValidator.from_identity(ident)
            )
            me = client.peer_id.to_base58()

            async def not_this_round(_info, _reader, writer) -> None:
                # The target pairs with us every round (see announce() below) and pushes to us: answer as a peer
                # in another round does (a refusal, not a fault). A member that ran no exchange at all would be
                # a fault each round it is planned, and banned before the cases below are done.
                writer.write(frame(response_header(ErrorCode.STALE_ROUND, "a probe: no exchange")))
                await writer.drain()
                writer.close()

            await client.add_binary_stream_handler(handler, not_this_round)

            async def send(raw: bytes) -> int:
                _, reader, writer = await client.call_binary_stream_handler(PeerID.from_base58(target), handler)
                writer.write(raw)
                await writer.drain()
                n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 60), "big")
                resp = msgpack.unpackb(await reader.readexactly(n))
                writer.close()
                return resp["status"]

            def frame(header: dict, body: bytes = b"") -> bytes:
                h = msgpack.packb(header)
                return len(h).to_bytes(4, "big") + h + body

            codec = PayloadCodec(shapes, {"theta": "parameter"}, spec.compression)  # NoLoCo, gamma == alpha
            parts = codec.parts()
            base = {"v": PROTOCOL_VERSION, "run": run, "type": "push", "round": 0, "sender": me}
            nan = {t.name: torch.full(t.shape, float("nan")) for t in codec.tensors}
            body = b"".join(len(d).to_bytes(4, "big") + d for d in (codec.encode_part(nan, p) for p in parts))

            def push(**over) -> dict:  # for the round the peer is in now (it only buffers rounds next to its own)
                return {**push_header(run, peer.round(), me, 7, 0, 1, {}, parts), **over}

            # No heartbeat yet: not a member. Refused at the door, before its header is read (an outsider takes
            # none of the slots members share), whatever it sends.
            codes = {
                "unauthorized": await send(frame(push(), body)),
                "outsider_garbage": await send(b"\x00\x00\x00\x08" + b"\xc1" * 8),
            }
            # A member as a live peer is one: its heartbeat kept fresh, at the target's round, within 2x the run's
            # TTL (records expiring later are refused), so the target counts it, and pairs with it, every round.
            ttl = spec.network.heartbeat_ttl_s

            async def announce() -> bool:
                return await store_heartbeat(dht, run, me, {"round": peer.round(), "join_round": 0}, ttl)

            async def keep_announcing() -> None:
                while True:
                    await asyncio.sleep(spec.network.heartbeat_interval_s)
                    await announce()

            assert await announce()
            beats = asyncio.create_task(keep_announcing())
            pull = frame({**base, "type": "pull", "round": 1000})  # a round it has no payload of (yet)
            for _ in range(60):  # until the target's view of the DHT holds our heartbeat: then NOT_READY
                codes["pull"] = await send(pull)
                if codes["pull"] != ErrorCode.UNAUTHORIZED:
                    break
                await asyncio.sleep(0.5)
            codes["garbage"] = await send(b"\x00\x00\x00\x08" + b"\xc1" * 8)
            codes["huge_header"] = await send((1 << 30).to_bytes(4, "big"))
            codes["bad_version"] = await send(frame({**base, "v": 999}))
            codes["wrong_run"] = await send(frame({**base, "run": "0" * 16}))
            codes["wrong_type"] = await send(frame({**base, "round": "three"}))
            codes["stalled"] = await send(frame(push()))  # the header, then nothing: cut after stall_timeout_s
            codes["oversized"] = await send(frame(push(), (2**32 - 1).to_bytes(4, "big")))
            codes["bad_shape"] = await send(frame(push(parts=[[0, 0, 999]])))
            codes["unknown_tensor"] = await send(frame(push(enc={"evil": 1})))
            codes["nan"] = await send(frame(push(xfer=8), body))
            codes["after_nine_faults"] = await send(frame(base))
            beats.cancel()
            await dht.shutdown()
            await client.shutdown()
            return codes

        codes = asyncio.run(probe())
        assert codes == {
            "garbage": ErrorCode.MALFORMED,
            "huge_header": ErrorCode.TOO_LARGE,
            "bad_version": ErrorCode.BAD_VERSION,
            "wrong_run": ErrorCode.WRONG_RUN,
            "wrong_type": ErrorCode.MALFORMED,
            "unauthorized": ErrorCode.UNAUTHORIZED,
            "outsider_garbage": ErrorCode.UNAUTHORIZED,
            "stalled": ErrorCode.TIMEOUT,  # neither is a fault
            "pull": ErrorCode.NOT_READY,  # a member asking for a payload we do not hold for it: not a fault
            "oversized": ErrorCode.TOO_LARGE,
            "bad_shape": ErrorCode.BAD_SHAPE,
            "unknown_tensor": ErrorCode.UNEXPECTED_TENSOR,
            "nan": ErrorCode.NOT_FINITE,
            # max_faults_before_ban = 9, and 9 faults so far: banned before anything it sends is read.
            "after_nine_faults": ErrorCode.BANNED,
        }
        wait_until(lambda: peer.round() >= started["round"] + 5, 120, "training goes on", [peer])
        peer.send_signal(signal.SIGINT)  # a clean stop: finish the step, checkpoint, shut down
        assert peer.wait(timeout=120) == 0, peer.tail()
    finally:
        peer.stop()
    fin = peer.events("finished")[0]
    # It trained on: its training loss fell. (Not the validation loss: this peer runs until the probe is done,
    # which under load is thousands of steps on a 1 MB corpus, and a nano model overfits that.)
    losses = [e["loss"] for e in peer.events("round")]
    assert fin["interrupted"] and math.isfinite(fin["final_loss"]) and losses[-1] < losses[0], losses
    assert (tmp_path / "ck" / "checkpoint.safetensors").exists()
    assert fin["errors_answered"]["BANNED"] >= 1
    (ban,) = peer.events("banned")  # the log says whom, for how long (bans end), after how many faults
    assert ban["for_s"] == 600.0 and ban["faults"] == 9 and ban["banned_peer"] in fin["banned_peers"]


@pytest.mark.parametrize("algo", ["gasloc", "sparseloco", "diloco"])
def test_local_swarm_command(tmp_path, algo):
    """`locomm-peer swarm` runs every daemon algorithm end to end and cleans up after itself."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "swarm",
            "--peers",
            "2",
            "--rounds",
            "4",
            "--inner-steps",
            "10",
            "--algo",
            algo,
            "--json",
            "--plot",
            str(tmp_path / "loss.png"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    seen: dict[int, Proc] = {}
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(proc.pid))
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    s = json.loads(stdout.strip().splitlines()[-1])
    assert s["peers"] == 2 and s["rounds_completed"] == 4 and s["failed_peers"] == []
    assert s["final_loss"] < s["initial_loss"] - 1.0
    assert s["bytes_sent"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert not list(tmpdir.glob("locomm-swarm-*"))  # no temp folders left
    assert any(a.comm == "p2pd" for a in seen.values())
    assert not [p for p in seen if alive(p)]  # no orphaned peer or p2pd


def _is_peer(pid: int) -> bool:
    """Whether ``pid`` is a `locomm-peer join` process (the launcher's reaper is a descendant too)."""
    return " join " in cmdline(pid)


@pytest.mark.parametrize("when", ["starting", "training"])
def test_swarm_ctrl_c_stops_everything(tmp_path, when):
    """SIGINT to `locomm-peer swarm` stops every peer and its p2pd, whenever it arrives.

    Deterministic under load: the test waits on the swarm's own process tree (not on the machine's
    p2pd count or a sleep), and the swarm's temporary folder lives in this test's TMPDIR.
    """
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "swarm",
            "--peers",
            "2",
            "--rounds",
            "500",
            "--inner-steps",
            "10",
            "--json",
            "--plot",
            str(tmp_path / "loss.png"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    seen: dict[int, Proc] = {}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, f"swarm not up: {seen}"
            seen.update(descendants(proc.pid))
            daemons = [p for p, a in seen.items() if a.comm == "p2pd" and alive(p)]
            if when == "starting" and any(_is_peer(p) for p in seen):  # a peer exists (not just the reaper)
                break
            if (
                when == "training"
                and len(daemons) >= 2
                and any('"event": "round"' in f.read_text() for f in tmpdir.glob("locomm-swarm-*/peer*.jsonl"))
            ):
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] and summary["rounds_completed"] < 500
    assert not list(tmpdir.glob("locomm-swarm-*"))
    seen.update(descendants(proc.pid))
    assert not [p for p in seen if alive(p)], f"left running: {[(p, seen[p]) for p in seen if alive(p)]}"

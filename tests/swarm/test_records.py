"""Signed records against a live swarm: a raw hivemind forger cannot overwrite a heartbeat, wipe the peers
key or replace the spec; a closed swarm keeps outsiders out (real `locomm-peer join` processes, real p2pd
and DHT on loopback; the forger is a bare DHTNode/P2P in the test)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgpack
import pytest

from locomm import PROTOCOL_VERSION
from locomm.config import RunSpec
from locomm.testing.launcher import Launcher, PeerProcess

pytestmark = pytest.mark.timeout(240)
ROUNDS_FOREVER = ("--until-round", "100000")


def _spec(tmp: Path) -> Path:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=0.5, batch_size=4, seq_len=32)
        .replace("outer", algo="noloco", inner_steps=5)
        .replace("train", steps=100000, eval_batches=1, eval_interval=0)
        .replace("network", heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0, request_timeout_s=5.0)
    )
    path = tmp / "run.toml"
    spec.save(path)
    return path


def _wait(cond, timeout: float, what: str, peers: tuple[PeerProcess, ...] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in peers:
            assert p.poll() is None, f"{p.name} exited: {p.tail()}"
        time.sleep(0.2)
    raise TimeoutError(what)


def _members(p: PeerProcess) -> list[str]:
    rounds = p.events("round")
    return rounds[-1]["member_ids"] if rounds else []


async def _client(tmp: Path, name: str, boot: str, validator_cls=None, **kw):
    """A bare P2P + DHTNode with an identity of its own; ``validator_cls(private_key, **kw)`` its validator."""
    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P

    from locomm.peer.records import load_identity

    ident = tmp / f"{name}.id"
    p2p = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(ident))
    validator = validator_cls(load_identity(ident), **kw) if validator_cls else None
    dht = await DHTNode.create(p2p=p2p, initial_peers=[boot], record_validator=validator)
    return p2p, dht, validator


async def _shut(*nodes) -> None:
    for n in nodes:
        await n.shutdown()


def test_forged_records_are_refused(tmp_path: Path, launcher: Launcher) -> None:
    """(a) another peer's heartbeat with a far expiration and join_round 2^31-1, (b) a plain value on the
    peers key, (c) another spec under the creator's key and under the forger's own: honest peers keep
    every honest heartbeat, and a joiner without --config takes the creator's spec."""
    from hivemind.utils import get_dht_time

    from locomm.peer.records import SwarmValidator, peers_key, spec_key
    from locomm.peer.swarm import fetch_spec, read_heartbeats

    cfg = _spec(tmp_path)
    together = (*ROUNDS_FOREVER, "--wait-for-peers", "3")  # nobody trained before all joined: no state sync
    a = launcher.start("a", *together, "--shard", "0/3", config=cfg)
    boot = a.address()
    b = launcher.start("b", *together, "--shard", "1/3", config=cfg, initial_peers=boot)
    c = launcher.start("c", *together, "--shard", "2/3", config=cfg, initial_peers=boot)
    honest = (a, b, c)
    _wait(lambda: all(p.events("started") for p in honest), 90, "three peers up", honest)
    ids = {p.name: p.events("started")[0]["peer"] for p in honest}
    run = a.events("started")[0]["run"]
    _wait(lambda: all(len(_members(p)) == 3 for p in honest), 90, "a round of three", honest)

    class Forger(SwarmValidator):
        def validate(self, record) -> bool:  # stores anything it is given, signs with its own key
            return True

    forged_spec = RunSpec.preset("nano").replace("data", corpus="~")

    async def attack() -> dict:
        p2p, dht, forger = await _client(tmp_path, "forger", boot, Forger)
        far = get_dht_time() + 10**6
        key = peers_key(run)
        forged = {"round": 2**31 - 1, "join_round": 2**31 - 1, "time": get_dht_time(), "version": "evil"}
        await dht.store(key, subkey=ids["b"], value=forged, expiration_time=far)  # (a)
        await dht.store(key, value="wiped", expiration_time=far + 1)  # (b)
        record = {"hash": forged_spec.hash(), "toml": forged_spec.to_toml(), "version": PROTOCOL_VERSION}
        await dht.store(spec_key(ids["a"]), {**record, "closed": False}, expiration_time=far)  # (c)
        await dht.store(spec_key(forger.peer_id), {**record, "closed": False}, expiration_time=far)
        # An honest reader (as every peer and `status` read): what verifies is all honest, with its own values.
        rp2p, rdht, reader = await _client(tmp_path, "reader", boot, SwarmValidator)
        reader.set_run(run, 3.0)
        reader.trust(ids["a"])
        beats, spec = [], None
        for _ in range(20):  # a fresh node's first lookups can miss (its routing table is still filling)
            beats = await read_heartbeats(rdht, run)
            spec = await fetch_spec(rdht, ids["a"])
            if len(beats) == 3 and spec is not None:
                break
            await asyncio.sleep(0.3)
        await _shut(rdht, rp2p, dht, p2p)
        return {"beats": beats, "spec": spec, "refused": reader.refused}

    at_attack = {p.name: p.round() for p in honest}
    seen = asyncio.run(attack())
    assert sorted(b.peer for b in seen["beats"]) == sorted(ids.values())
    assert all(b.join_round < 2**31 - 1 and b.version != "evil" for b in seen["beats"])
    assert seen["spec"]["hash"] != forged_spec.hash() and seen["spec"]["toml"] == RunSpec.load(cfg).to_toml()
    # Each honest peer trains on with all three: its rounds after the attack count every honest peer.
    _wait(lambda: all(p.round() >= at_attack[p.name] + 3 for p in honest), 90, "rounds after the attack", honest)
    for p in honest:
        assert sorted(_members(p)) == sorted(ids.values()), (p.name, _members(p))
    # A joiner without --config (a host whose spec is only the default) takes the creator's spec.
    from locomm.peer.host import Host, NodeOptions

    async def joiner() -> str:
        async with Host(RunSpec.preset("nano"), NodeOptions(initial_peers=(boot,), spec_from_user=False)) as host:
            return host.run_id

    assert asyncio.run(joiner()) == run


def test_a_closed_swarm_keeps_outsiders_out(tmp_path: Path, launcher: Launcher) -> None:
    """Without the key (or with a wrong one) a join exits 2 within 60 s; a raw outsider's pull and state
    request get UNAUTHORIZED; `status` with the key lists the key holders only."""
    from locomm.cli.status import snapshot
    from locomm.peer.records import SwarmValidator
    from locomm.peer.swarm import store_heartbeat
    from locomm.protocol.messages import ErrorCode, pull_header, state_manifest_header

    cfg = _spec(tmp_path)
    key, wrong = tmp_path / "swarm.key", tmp_path / "wrong.key"
    key.write_bytes(os.urandom(32))
    wrong.write_bytes(os.urandom(32))
    holder = (*ROUNDS_FOREVER, "--wait-for-peers", "2", "--swarm-key", str(key))
    e = launcher.start("e", *holder, "--shard", "0/2", config=cfg)
    boot = e.address()
    t0 = time.monotonic()
    h = launcher.start("h", *holder, "--shard", "1/2", config=cfg, initial_peers=boot)
    nokey = launcher.start("nokey", initial_peers=boot)
    badkey = launcher.start("badkey", "--swarm-key", str(wrong), initial_peers=boot)
    assert nokey.wait(timeout=60) == 2 and badkey.wait(timeout=max(1.0, 60 - (time.monotonic() - t0))) == 2
    assert time.monotonic() - t0 < 60
    assert nokey.tail().strip().splitlines()[-1] == "error: this swarm is closed: pass --swarm-key"
    assert "--swarm-key" in badkey.tail().strip().splitlines()[-1]
    _wait(lambda: len(_members(e)) == 2 and len(_members(h)) == 2, 90, "the key holders train together", (e, h))
    run, target = e.events("started")[0]["run"], e.events("started")[0]["peer"]

    async def probe() -> dict:
        from hivemind.p2p import PeerID

        p2p, dht, me = await _client(tmp_path, "outsider", boot, SwarmValidator)
        await store_heartbeat(dht, run, me.peer_id, {"round": 0, "join_round": 0}, 3.0)  # refused by the swarm

        async def send(handler: str, header: dict) -> int:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(target), handler)
            raw = msgpack.packb(header)
            writer.write(len(raw).to_bytes(4, "big") + raw)
            await writer.drain()
            n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 30), "big")
            resp = msgpack.unpackb(await reader.readexactly(n))
            writer.close()
            return resp["status"]

        await asyncio.sleep(1.0)  # past the target's heartbeat read that would have seen our record
        codes = {
            "pull": await send(f"locomm.{run}.gossip", pull_header(run, 0, me.peer_id)),
            "state": await send(f"locomm.{run}.state", state_manifest_header(run, me.peer_id)),
        }
        await _shut(dht, p2p)
        return codes

    assert asyncio.run(probe()) == {"pull": ErrorCode.UNAUTHORIZED, "state": ErrorCode.UNAUTHORIZED}
    admitted = {p.events("started")[0]["peer"] for p in (e, h)}
    view = asyncio.run(asyncio.wait_for(snapshot([boot], key), 60))
    assert view["closed"] and {p["peer"] for p in view["peers"]} == admitted, view
    assert "closed" in asyncio.run(asyncio.wait_for(snapshot([boot]), 60))["error"]

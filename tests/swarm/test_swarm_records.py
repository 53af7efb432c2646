"""Signed records against a live swarm (real `locomm-peer join` processes, real p2pd and DHT on loopback;
forgers, outsiders and readers are bare hivemind DHTNode/P2P nodes in the test).

One closed 3-peer swarm shows both halves of issue 17's records and closed-swarm must-shows: outsiders
(without the key, with a wrong one) are kept out, and a forger holding the key (an insider) still cannot
overwrite a heartbeat, wipe the peers key or replace the creator's spec. The open-swarm spec check needs
no training peers: an in-process creator Host, a forger and a joiner Host."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgpack
import pytest

from locomm import PROTOCOL_VERSION, __version__
from locomm.config import RunSpec
from locomm.testing.launcher import Launcher, PeerProcess

pytestmark = pytest.mark.timeout(240)
EVIL = 2**31 - 1


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


def _forger_cls():
    from locomm.peer.transport.records import SwarmValidator

    class Forger(SwarmValidator):
        """Stores anything it is given (it is the forger's own node); signs with the forger's own key."""

        def validate(self, record) -> bool:
            return True

    return Forger


async def _client(tmp: Path, name: str, boot: str, validator_cls=None, *, guard=None, **kw):
    """A bare P2P + DHTNode with an identity of its own; ``validator_cls(private_key, **kw)`` its validator,
    ``guard(validator)`` called before the node joins (as a Host sets its validator up)."""
    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P

    from locomm.peer.transport.records import load_identity

    ident = tmp / f"{name}.id"
    p2p = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(ident))
    validator = validator_cls(load_identity(ident), **kw) if validator_cls else None
    if guard is not None:
        guard(validator)
    dht = await DHTNode.create(p2p=p2p, initial_peers=[boot], record_validator=validator)
    return p2p, dht, validator


async def _shut(*nodes) -> None:
    for n in nodes:
        await n.shutdown()


def _forged_spec_record(closed: bool) -> tuple[RunSpec, dict]:
    forged = RunSpec.preset("nano").replace("data", corpus="~")  # the owner's home folder, were it adopted
    return forged, {"hash": forged.hash(), "toml": forged.to_toml(), "version": PROTOCOL_VERSION, "closed": closed}


async def _open_swarm_spec(tmp: Path, cfg: Path) -> dict:
    """An open swarm: a forger stores another spec under the creator's key and under its own, and one under
    the key of a joiner that has not joined yet. The joiner, without --config, takes the creator's spec; the
    creator, which took the joiner's forgery before it knew whose key that was (a validator learns a peer's
    spec key once that peer's record verifies), still reads the joiner's own spec."""
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import P2P
    from hivemind.utils import get_dht_time

    from locomm.peer.host import Host
    from locomm.peer.options import NodeOptions
    from locomm.peer.transport.records import SwarmValidator, load_identity, spec_key
    from locomm.peer.transport.swarm import fetch_spec

    spec = RunSpec.load(cfg)
    ident = tmp / "open-joiner.id"
    P2P.generate_identity(str(ident))
    jid = SwarmValidator(load_identity(ident)).peer_id
    out: dict = {"hash": spec.hash()}
    async with Host(spec, NodeOptions()) as creator:
        boot = str(creator.maddrs[0])
        p2p, dht, forger = await _client(tmp, "open-forger", boot, _forger_cls())
        forged, record = _forged_spec_record(closed=False)
        out["forged"] = forged.hash()
        far = get_dht_time() + 10**6
        at_creator, at_joiner = DHTID.generate(source=spec_key(creator.me)), DHTID.generate(source=spec_key(jid))
        await dht.store(spec_key(creator.me), record, expiration_time=far)
        await dht.store(spec_key(jid), record, expiration_time=far)
        # Its own key with a valid expiration is taken: a second, validly signed spec in this DHT, which a
        # joiner that names the creator must not adopt.
        out["own_taken"] = await dht.store(spec_key(forger.peer_id), record, get_dht_time() + 600, exclude_self=True)
        held = creator.dht.protocol.storage.get(at_creator)
        out["creator_refused"] = held is not None and held.expiration_time < far  # it holds its own
        held = creator.dht.protocol.storage.get(at_joiner)
        out["creator_took_joiner_forgery"] = held is not None and held.expiration_time >= far
        opts = NodeOptions(initial_peers=(boot,), spec_from_user=False, identity=ident)
        async with Host(RunSpec.preset("nano"), opts) as joiner:
            assert joiner.me == jid
            out["joiner"] = joiner.spec.hash()
            out["joiner_run"], out["creator_run"] = joiner.run_id, creator.run_id
            got = await fetch_spec(creator.dht, jid)
            out["joiner_spec_at_creator"] = got and got["hash"]
        await _shut(dht, p2p)
    return out


def test_forged_records_and_outsiders_are_refused(tmp_path: Path, launcher: Launcher) -> None:
    """A closed 3-peer swarm. Outsiders: a `join` without the key or with a wrong one exits 2 within 60 s
    with a one-line error; a raw outsider's own heartbeat and spec are refused (not admitted by the key), its
    push, pull and state requests get UNAUTHORIZED, and no peer ever counts it. An insider forger (it holds
    the key) stores (a) another peer's heartbeat with a far expiration and join_round 2^31-1, (b) a plain
    value on the peers key with a later expiration, (c) another spec under the creator's key: every honest
    node refuses each, the honest peers train on counting all three with their own values, `status
    --swarm-key` lists exactly them with their own records and the creator's spec, and a joiner without
    --config takes the creator's spec. Plus the open swarm's spec check (``_open_swarm_spec``)."""
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    from locomm.cli.status import snapshot
    from locomm.peer.host import Host
    from locomm.peer.options import NodeOptions
    from locomm.peer.transport.records import SwarmKey, SwarmValidator, peers_key, spec_key
    from locomm.peer.transport.swarm import fetch_spec
    from locomm.protocol.messages import ErrorCode, pull_header, push_header
    from locomm.protocol.state_messages import state_manifest_header

    cfg = _spec(tmp_path)
    key, wrong = tmp_path / "swarm.key", tmp_path / "wrong.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)  # a secret: locomm refuses one others can read
    wrong.write_bytes(os.urandom(32))
    wrong.chmod(0o600)  # a secret: locomm refuses one others can read
    closed = ("--until-round", "100000", "--wait-for-peers", "3", "--swarm-key", str(key))
    a = launcher.start("a", *closed, "--shard", "0/3", config=cfg)
    boot = a.address()
    t0 = time.monotonic()
    b = launcher.start("b", *closed, "--shard", "1/3", config=cfg, initial_peers=boot)
    c = launcher.start("c", *closed, "--shard", "2/3", config=cfg, initial_peers=boot)
    nokey = launcher.start("nokey", initial_peers=boot)
    badkey = launcher.start("badkey", "--swarm-key", str(wrong), initial_peers=boot)
    honest = (a, b, c)

    # While the swarm comes up: the open swarm's spec check (in-process nodes of its own).
    opened = asyncio.run(asyncio.wait_for(_open_swarm_spec(tmp_path, cfg), 90))
    assert opened["creator_refused"] and opened["own_taken"], opened
    assert opened["joiner"] == opened["hash"] != opened["forged"], opened
    assert opened["joiner_run"] == opened["creator_run"], opened
    assert opened["creator_took_joiner_forgery"], opened  # the forgery sat in the creator's storage ...
    assert opened["joiner_spec_at_creator"] == opened["hash"], opened  # ... and hid nothing

    # Outsiders' joins: status 2 within 60 s, one line.
    assert nokey.wait(timeout=max(1.0, 60 - (time.monotonic() - t0))) == 2, nokey.tail()
    assert badkey.wait(timeout=max(1.0, 60 - (time.monotonic() - t0))) == 2, badkey.tail()
    assert time.monotonic() - t0 < 60
    assert nokey.tail().strip().splitlines() == ["error: this swarm is closed: pass --swarm-key"], nokey.tail()
    bad = badkey.tail().strip().splitlines()
    assert len(bad) == 1 and bad[0].startswith("error: ") and "--swarm-key" in bad[0], bad

    _wait(lambda: all(len(_members(p)) == 3 for p in honest), 90, "a round of three", honest)
    ids = {p.name: p.events("started")[0]["peer"] for p in honest}
    run = a.events("started")[0]["run"]
    swarm_key = SwarmKey.load(key)

    async def attack() -> dict:
        out: dict = {}
        pk = peers_key(run)
        # An outsider (no key): its own, validly signed records are refused for lacking the key ...
        p2p, dht, me = await _client(tmp_path, "outsider", boot, SwarmValidator)
        now = get_dht_time()
        beat = {"round": 0, "join_round": 0, "time": now, "version": "outsider"}
        _, own = _forged_spec_record(closed=True)
        out["outsider_stored"] = [
            await dht.store(pk, subkey=me.peer_id, value=beat, expiration_time=now + 3, exclude_self=True),
            await dht.store(spec_key(me.peer_id), own, expiration_time=now + 600, exclude_self=True),
        ]

        # ... and every service refuses it before reading a body (the host's authorize hook reads the DHT
        # afresh for a peer it has not seen: the stored heartbeat, had it been taken, would be seen).
        async def send(handler: str, header: dict) -> int:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(ids["a"]), handler)
            raw = msgpack.packb(header)
            writer.write(len(raw).to_bytes(4, "big") + raw)
            await writer.drain()
            n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 30), "big")
            resp = msgpack.unpackb(await reader.readexactly(n))
            writer.close()
            return resp["status"]

        rnd = a.round()
        out["codes"] = {
            "push": await send(f"locomm.{run}.gossip", push_header(run, rnd, me.peer_id, 7, 0, 1, {}, [])),
            "pull": await send(f"locomm.{run}.gossip", pull_header(run, rnd, me.peer_id)),
            "state": await send(f"locomm.{run}.state", state_manifest_header(run, me.peer_id)),
        }
        out["outsider"] = me.peer_id
        await _shut(dht, p2p)

        # An insider forger (it holds the key): what it writes in others' names is refused by every honest node
        # (exclude_self: the answer is the honest replicas', not its own storage's).
        p2p, dht, forger = await _client(tmp_path, "insider", boot, _forger_cls(), swarm_key=swarm_key)
        now = get_dht_time()
        far = now + 10**6
        out["at_attack"] = {p.name: p.round() for p in honest}
        forged_beat = {"round": EVIL, "join_round": EVIL, "time": now, "version": "evil"}
        forged, record = _forged_spec_record(closed=True)
        out["forged_hash"] = forged.hash()
        out["insider_stored"] = {
            "heartbeat": await dht.store(
                pk, subkey=ids["b"], value=forged_beat, expiration_time=far, exclude_self=True
            ),
            "wipe": await dht.store(pk, value="wiped", expiration_time=far + 1, exclude_self=True),
            "spec": await dht.store(spec_key(ids["a"]), record, expiration_time=far, exclude_self=True),
            # Its own spec, validly signed and admitted: taken (the refusals above are the rules', not the key's).
            "own_spec": await dht.store(spec_key(forger.peer_id), record, now + 600, exclude_self=True),
        }
        await _shut(dht, p2p)

        # An honest reader of the records (guarded as a peer is, from the start): the heartbeats' dictionary is
        # signed by its owners only, and the creator's spec is the creator's.
        def guard(v: SwarmValidator) -> None:
            v.set_run(run, 3.0)
            v.trust(ids["a"])

        rp2p, rdht, _ = await _client(tmp_path, "reader", boot, SwarmValidator, guard=guard, swarm_key=swarm_key)
        for _ in range(20):  # a fresh node's first lookups can miss (its routing table is still filling)
            found = await rdht.get(pk, latest=True)
            out["raw"] = {s: getattr(v, "value", None) for s, v in found.value.items()} if found is not None else {}
            out["after_read"] = {p.name: p.round() for p in honest}
            out["spec"] = await fetch_spec(rdht, ids["a"])
            if len(out["raw"]) >= 3 and out["spec"] is not None:
                break
            await asyncio.sleep(0.3)
        await _shut(rdht, rp2p)
        # `status` with the key (the user's view; read again while a fresh client misses some) and without it.
        out["status"] = []
        for _ in range(5):
            out["status"].append(await asyncio.wait_for(snapshot([boot], key), 60))
            if len(out["status"][-1].get("peers", ())) >= 3:
                break
        out["status_nokey"] = await asyncio.wait_for(snapshot([boot]), 60)
        # A joiner without --config (its spec only the default), holding the key.
        opts = NodeOptions(initial_peers=(boot,), spec_from_user=False, swarm_key=key)
        async with Host(RunSpec.preset("nano"), opts) as joiner:
            out["joiner_run"] = joiner.run_id
        return out

    seen = asyncio.run(asyncio.wait_for(attack(), 120))
    at_attack = seen["at_attack"]
    assert seen["outsider_stored"] == [False, False], seen["outsider_stored"]
    assert seen["codes"] == {k: ErrorCode.UNAUTHORIZED for k in ("push", "pull", "state")}, seen["codes"]
    assert seen["insider_stored"] == {"heartbeat": False, "wipe": False, "spec": False, "own_spec": True}, seen
    # (a), (b): the peers key is still the dictionary of the three honest heartbeats, each with its own values.
    assert sorted(seen["raw"]) == sorted(ids.values()), seen["raw"]
    for name, peer in ids.items():  # its own values: this version's, its own round (as its log says)
        v = seen["raw"][peer]
        assert isinstance(v, dict) and v["version"] == __version__ and v["join_round"] < EVIL, v
        assert at_attack[name] - 1 <= v["round"] <= seen["after_read"][name] + 1, (name, v, at_attack)
    # (c): the creator's spec, and a joiner (with the key, without --config) takes it.
    want = RunSpec.load(cfg)
    assert seen["spec"]["hash"] == want.hash() != seen["forged_hash"] and seen["spec"]["toml"] == want.to_toml()
    assert seen["joiner_run"] == run
    # `status --swarm-key` lists exactly the admitted peers, with their own values; without the key: closed.
    for view in seen["status"]:  # never anyone else, and (the last) every one of them
        assert view["closed"] and view["spec_hash"] == want.hash(), view
        assert {p["peer"] for p in view["peers"]} <= set(ids.values()), view
        assert all(p["join_round"] < EVIL and p["version"] == __version__ for p in view["peers"]), view
    assert sorted(p["peer"] for p in seen["status"][-1]["peers"]) == sorted(ids.values()), seen["status"]
    assert "closed" in seen["status_nokey"]["error"], seen["status_nokey"]

    # The honest peers train on counting every honest peer, and never the outsider, in the rounds after the attack.
    _wait(lambda: all(p.round() >= at_attack[p.name] + 3 for p in honest), 90, "rounds after the attack", honest)
    for p in honest:
        after = [r for r in p.events("round") if r["round"] > at_attack[p.name]]
        assert len(after) >= 2 and all(sorted(r["member_ids"]) == sorted(ids.values()) for r in after), (p.name, after)
        assert not any(seen["outsider"] in r["member_ids"] for r in p.events("round")), p.name


def _admit(*args: str) -> dict:
    """``locomm-peer admit ARGS --json``: its JSON line."""
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "admit", *args, "--json"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_admission_certificates_keep_minted_identities_out(tmp_path: Path, launcher: Launcher) -> None:
    """A founder admits two peers (`admit`); they train together. Minted identities are refused at the door: a
    raw node holding a rogue founder's certificate stores a heartbeat no honest node takes, one carrying a
    member's stolen certificate likewise, and a `join` with a rogue certificate exits 2; the members never count
    either, and go on training."""

    from hivemind.utils import get_dht_time

    from locomm.peer.transport.admission import Certificate, load_founder
    from locomm.peer.transport.records import SwarmKey, SwarmValidator, peers_key

    _admit("--new-founder", str(tmp_path / "founder.key"))
    _admit("--new-founder", str(tmp_path / "rogue.key"))
    certs = {}
    for name, founder in (("a", "founder"), ("b", "founder"), ("m", "rogue")):
        pid = _admit("--show-id", "--identity", str(tmp_path / f"{name}.id"))["peer_id"]
        _admit(
            "--founder-key", str(tmp_path / f"{founder}.key"), "--peer", pid, "--out", str(tmp_path / f"{name}.cert")
        )
        certs[name] = pid
    cfg = _spec(tmp_path)

    def member(name: str, *args: str, initial: str | None = None, config: Path | None = cfg) -> PeerProcess:
        ident = ("--identity", str(tmp_path / f"{name}.id"), "--swarm-key", str(tmp_path / f"{name}.cert"))
        return launcher.start(name, *ident, *args, config=config, initial_peers=initial)

    a = member("a", "--until-round", "100000", "--wait-for-peers", "2", "--shard", "0/2")
    boot = a.address()
    b = member("b", "--until-round", "100000", "--wait-for-peers", "2", "--shard", "1/2", initial=boot)
    minted = member("m", initial=boot, config=None)  # a rogue founder's certificate: it sees no spec it can trust
    assert minted.wait(timeout=90) == 2, minted.tail()
    assert minted.tail().strip().startswith("error: "), minted.tail()
    _wait(lambda: all(len(_members(p)) == 2 for p in (a, b)), 120, "a round of the two members", (a, b))
    run = a.events("started")[0]["run"]

    async def mint() -> list[bool]:
        stored = []
        rogue = load_founder(tmp_path / "rogue.key")
        stolen = Certificate.load(tmp_path / "a.cert")
        for name, cert in (("mint1", None), ("mint2", stolen)):
            key = SwarmKey(certificate=cert) if cert is not None else None
            p2p, dht, me = await _client(tmp_path, name, boot, SwarmValidator, swarm_key=key)
            if cert is None:  # a certificate of the rogue founder, for this very identity
                me.swarm_key = SwarmKey(certificate=Certificate.issue(rogue, me.peer_id, time.time() + 3600))
            now = get_dht_time()
            beat = {"round": 0, "join_round": 0, "time": now, "version": "minted", "round_s": 1.0}
            stored.append(
                await dht.store(
                    peers_key(run), subkey=me.peer_id, value=beat, expiration_time=now + 3, exclude_self=True
                )
            )
            await _shut(dht, p2p)
        return stored

    assert asyncio.run(asyncio.wait_for(mint(), 90)) == [False, False]
    r0 = a.round()
    _wait(lambda: a.round() >= r0 + 3, 90, "three more rounds", (a, b))
    counted = {m for p in (a, b) for e in p.events("round") for m in e["member_ids"]}
    assert counted == {certs["a"], certs["b"]}, counted


def test_join_by_swarm_id_through_a_bare_hivemind_dht_node(tmp_path: Path, launcher: Launcher) -> None:
    """`join --swarm ID`: a member with its certificate and no --config takes the spec the founder's members store,
    through a plain hivemind DHT node that publishes no spec and checks nothing (before, such a joiner exited 2,
    "no run spec found"); a wrong id, or an id without a certificate, exits 2 with the fix."""
    import subprocess

    import hivemind

    swarm_id = _admit("--new-founder", str(tmp_path / "founder.key"))["swarm_id"]
    for name in ("a", "b"):
        pid = _admit("--show-id", "--identity", str(tmp_path / f"{name}.id"))["peer_id"]
        _admit("--founder-key", str(tmp_path / "founder.key"), "--peer", pid, "--out", str(tmp_path / f"{name}.cert"))
    bare = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        boot = [str(m) for m in bare.get_visible_maddrs()][0]

        def member(name: str, *args: str, config: Path | None = None, who: str | None = None) -> PeerProcess:
            who = who or name
            ident = ("--identity", str(tmp_path / f"{who}.id"), "--swarm-key", str(tmp_path / f"{who}.cert"))
            return launcher.start(name, *ident, *args, config=config, initial_peers=boot)

        run = ("--until-round", "100000", "--wait-for-peers", "2")
        a = member("a", *run, "--shard", "0/2", config=_spec(tmp_path))  # the founder's first member: its spec
        wrong = member("wrong", "--swarm", "0" * 32, who="b")
        assert wrong.wait(timeout=60) == 2 and "is of swarm" in wrong.tail(), wrong.tail()
        b = member("b", *run, "--shard", "1/2", "--swarm", swarm_id)  # no --config
        _wait(lambda: all(len(_members(p)) == 2 for p in (a, b)), 150, "a round of the two members", (a, b))
        assert b.events("started")[0]["run"] == a.events("started")[0]["run"]
    finally:
        bare.shutdown()
    r = subprocess.run(
        launcher.command("--initial-peers", boot, "--swarm", swarm_id), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "needs your admission certificate" in r.stderr, r.stderr[-1000:]

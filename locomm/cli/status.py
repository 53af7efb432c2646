"""`locomm-peer status`: read the run spec and heartbeats from the DHT and print the swarm.

Every record is checked as a peer checks it (``peer/transport/records.py``): the spec is the one the peers named in
--initial-peers signed, and only heartbeats whose signature (and, with --swarm-key, admission) verifies
are listed; each listed peer is asked a hello, and one that does not answer shows "no answer" (the peers count
only identities they have seen alive: ``protocol/sightings.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

STALE_AFTER_S = 15.0
HELLO_S = 5.0
"""How long a peer has to answer status's hello (``peer/transport/hello.py``) before it shows "no answer"."""
ANSWERED_S = 30.0
"""A reader that keeps reading (``--watch``, ``--serve``) shows a peer that answered within this long as training,
though its latest hello went unanswered: a peer busy for a few seconds (a long step on loaded cores) is not
"no answer" until it misses hellos for this long."""


def unnamed(initial_peers: list[str]) -> str | None:
    """The error when no ``--initial-peers`` names its peer (a reader trusts only the specs those peers sign)."""
    from locomm.peer.transport.swarm import peer_ids_of  # noqa: PLC0415

    if not peer_ids_of(initial_peers):
        return "--initial-peers must name the peer: a multiaddr ending in /p2p/<peer id>"
    return None


class SwarmReader:
    """One DHT client on the swarm, kept open: ``read()`` returns a snapshot each time it is called (``status
    --watch`` polls one, instead of a new p2pd and DHT node per refresh, which took tens of seconds on 2 cores).
    The run spec is looked up once, then only the heartbeats are read."""

    def __init__(self, initial_peers: list[str], swarm_key: Path | None = None) -> None:
        from locomm.peer.transport.records import SwarmKey, SwarmValidator  # noqa: PLC0415
        from locomm.peer.transport.swarm import peer_ids_of  # noqa: PLC0415

        self.initial_peers = initial_peers
        self.trusted = peer_ids_of(initial_peers)
        self.key = SwarmKey.load(swarm_key) if swarm_key is not None else None
        self.validator = SwarmValidator(swarm_key=self.key)  # a reader: checks every record, signs none
        for peer in self.trusted:
            self.validator.trust(peer)
        self.p2p: Any = None
        self.dht: Any = None
        self.spec: dict[str, Any] | None = None
        self.answered_at: dict[str, float] = {}
        """Per peer, when it last answered our hello (time.monotonic())."""

    async def __aenter__(self) -> SwarmReader:
        from hivemind.dht import DHTNode  # noqa: PLC0415
        from hivemind.p2p import P2P  # noqa: PLC0415

        self.p2p = await P2P.create(initial_peers=self.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            self.dht = await DHTNode.create(
                p2p=self.p2p, initial_peers=self.initial_peers, client_mode=True, record_validator=self.validator
            )
        except BaseException:
            await self.p2p.shutdown()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.dht is not None:
                await self.dht.shutdown()
        finally:
            await self.p2p.shutdown()

    async def find_spec(self) -> str | None:
        """Look up the run spec the trusted peers sign (once); an error message, or None when it is found."""
        from locomm.config import RunSpec  # noqa: PLC0415
        from locomm.peer.transport.swarm import fetch_spec  # noqa: PLC0415

        if self.spec is None:
            for _ in range(6):  # a fresh client's first lookups can miss
                specs = [await fetch_spec(self.dht, peer) for peer in self.trusted]
                self.spec = next((s for s in specs if s is not None), None)
                if self.spec is not None:
                    break
                await asyncio.sleep(0.5)
            if self.spec is None:
                signed = (
                    "that verifies with this --swarm-key" if self.key is not None else "signed by the --initial-peers"
                )
                return f"no locomm run spec {signed} in this DHT"
            if self.spec["closed"] and self.key is None:
                self.spec = None  # looked up again next time, with the key the user passes then
                return "this swarm is closed: pass --swarm-key"
            self.validator.set_run(self.spec["hash"][:16], RunSpec.from_toml(self.spec["toml"]).network.heartbeat_ttl_s)
        return None

    async def read(self) -> dict[str, Any]:
        from hivemind.utils import get_dht_time  # noqa: PLC0415

        from locomm.peer.transport import hello  # noqa: PLC0415
        from locomm.peer.transport.swarm import read_heartbeats  # noqa: PLC0415

        if (error := await self.find_spec()) is not None:
            return {"error": error}
        spec = self.spec
        assert spec is not None
        run_id = spec["hash"][:16]
        beats = await read_heartbeats(self.dht, run_id)
        now = get_dht_time()
        # A heartbeat is a signed record anyone with a key can store; whether a p2pd answers for it is what
        # the peers themselves count by (protocol/sightings.py): ask each, as they do.
        answers = await asyncio.gather(*(hello.ask(self.p2p, run_id, b.peer, HELLO_S) for b in beats))
        t = time.monotonic()
        self.answered_at |= {b.peer: t for b, a in zip(beats, answers, strict=True) if a}
        self.answered_at = {p: when for p, when in self.answered_at.items() if when > t - ANSWERED_S}
        peers = []
        for b, answered_now in zip(beats, answers, strict=True):
            answered = b.peer in self.answered_at
            peers.append(
                {
                    "peer": b.peer,
                    "answers": answered_now,
                    "round": b.round,
                    "join_round": b.join_round,
                    "admitted": b.admitted,
                    "step": b.step,
                    "loss": b.loss,
                    "val_loss": b.val_loss,
                    "tokens_per_s": b.tokens_per_s,
                    "bytes_sent": b.bytes_sent,
                    "last_exchange_s_ago": (time.time() - b.last_exchange) if b.last_exchange else None,
                    "heartbeat_age_s": now - (b.time or now),
                    "version": b.version,
                    "state": (
                        "left" if b.finished else "paused" if b.paused else "training" if answered else "no answer"
                    ),
                    "eta_s": b.eta_s,
                    "island": b.island or None,
                    "island_rep": b.island_rep,
                    # pipeline mode: the stage this peer serves, its micro-batches/s, re-routes, losses
                    **(
                        {"stage": b.stage, "mb_per_s": b.mb_per_s, "rerouted": b.rerouted, "lost": b.lost}
                        if b.stage is not None
                        else {}
                    ),
                }
            )
        return {
            "run": run_id,
            "spec_hash": spec["hash"],
            "protocol_version": spec["version"],
            "closed": spec["closed"],
            "peers": peers,
            "islands": islands_of(peers),
        }


async def swarm_spec_toml(initial_peers: list[str], swarm_key: Path | None = None) -> str:
    """The TOML of the run spec the swarm's named peers sign (``join --plan --initial-peers``: plan the batch
    of the swarm one is about to join, not a local preset). Raises ConfigError when there is none."""
    from locomm.config import ConfigError  # noqa: PLC0415

    if (error := unnamed(initial_peers)) is not None:
        raise ConfigError(error)
    async with SwarmReader(initial_peers, swarm_key) as reader:
        if (error := await reader.find_spec()) is not None:
            raise ConfigError(error)
        assert reader.spec is not None
        return str(reader.spec["toml"])


async def snapshot(initial_peers: list[str], swarm_key: Path | None = None) -> dict[str, Any]:
    """One read of the swarm (a client opened and closed)."""
    if (error := unnamed(initial_peers)) is not None:
        return {"error": error}
    async with SwarmReader(initial_peers, swarm_key) as reader:
        return await reader.read()


def islands_of(peers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each island's members and representative, from the peers' heartbeats (``join --island``)."""
    out: dict[str, dict[str, Any]] = {}
    for p in peers:
        if p.get("island") and p.get("state") != "left":
            isl = out.setdefault(p["island"], {"members": [], "representative": None})
            isl["members"].append(p["peer"])
            if p.get("island_rep"):
                isl["representative"] = p["peer"]
    return out


def render(snap: dict[str, Any]) -> Table:
    if any("stage" in p for p in snap.get("peers", [])):
        return render_stages(snap)
    islands = snap.get("islands") or {}
    title = f"run {snap.get('run', '?')}: {len(snap.get('peers', []))} peers"
    if islands:
        title += ", islands " + "; ".join(
            f"{name}: {len(i['members'])} peers, representative {(i['representative'] or '?')[-10:]}"
            for name, i in sorted(islands.items())
        )
    t = Table(title=title)
    cols = ("peer", "state", "island", "round", "step", "loss", "val", "tok/s", "round ETA", "MB sent", "last exchange")
    for col in (*cols, "staleness"):
        t.add_column(col, justify="right")
    top = max((p["round"] for p in snap.get("peers", [])), default=0)
    for p in snap.get("peers", []):
        stale = p["heartbeat_age_s"] > STALE_AFTER_S
        t.add_row(
            p["peer"][-10:],
            p.get("state", "?"),
            (p["island"] + (" (rep)" if p.get("island_rep") else "")) if p.get("island") else "-",
            str(p["round"]),
            str(p["step"]),
            _f(p["loss"]),
            _f(p["val_loss"]),
            _f(p["tokens_per_s"], "{:,.0f}"),
            _f(p.get("eta_s"), "{:.0f}s"),
            _f((p["bytes_sent"] or 0) / 1e6, "{:.1f}"),
            _f(p["last_exchange_s_ago"], "{:.0f}s ago"),
            f"{top - p['round']} rounds" + (" (stale)" if stale else ""),
        )
    return t


def render_stages(snap: dict[str, Any]) -> Table:
    """Pipeline mode: each stage's replicas, their micro-batches per second and re-routes."""
    peers = sorted(
        (p for p in snap.get("peers", []) if isinstance(p.get("stage"), int) and p["stage"] >= 0),
        key=lambda p: (p["stage"], p["peer"]),
    )
    stages = sorted({p["stage"] for p in peers})
    t = Table(title=f"run {snap.get('run', '?')}: {len(stages)} stages, {len(peers)} stage replicas")
    for col in ("stage", "replicas", "peer", "state", "step", "loss", "mb/s", "re-routed", "lost", "staleness"):
        t.add_column(col, justify="right")
    for p in peers:
        n = sum(1 for q in peers if q["stage"] == p["stage"])
        t.add_row(
            str(p["stage"]),
            str(n),
            p["peer"][-10:],
            p.get("state", "?"),
            str(p["step"]),
            _f(p["loss"]),
            _f(p.get("mb_per_s"), "{:.2f}"),
            str(p.get("rerouted") or 0),
            str(p.get("lost") or 0),
            f"{p['heartbeat_age_s']:.0f}s",
        )
    return t


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


async def read_forever(
    initial_peers: list[str], swarm_key: Path | None = None, interval_s: float = 2.0
) -> AsyncIterator[dict[str, Any]]:
    """Snapshots of the swarm every ``interval_s``, from one DHT client (a new one only after a failure); a read
    that fails yields ``{"error": ...}`` (an unreachable swarm, a bad multiaddr: one line, not a traceback)."""
    reader: SwarmReader | None = None
    try:
        while True:
            try:
                if reader is None:
                    reader = await asyncio.wait_for(SwarmReader(initial_peers, swarm_key).__aenter__(), 60)
                snap = await asyncio.wait_for(reader.read(), 60)
            except Exception as e:  # noqa: BLE001 - shown to the user, then read again
                snap = {"error": f"cannot read the swarm: {type(e).__name__}: {e}"}
                if reader is not None:
                    with contextlib.suppress(Exception):
                        await reader.__aexit__(None, None, None)
                    reader = None
            yield snap
            await asyncio.sleep(interval_s)
    finally:
        if reader is not None:
            with contextlib.suppress(Exception):
                await reader.__aexit__(None, None, None)


def show_status(initial_peers: list[str], *, watch: bool, as_json: bool, swarm_key: Path | None = None) -> None:
    console = Console()

    async def run() -> None:
        if (error := unnamed(initial_peers)) is not None:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        snaps = read_forever(initial_peers, swarm_key)
        try:
            async for snap in snaps:  # --watch outlives a swarm that is restarting or not up yet
                if "error" in snap:
                    print(f"error: {snap['error']}", file=sys.stderr)
                    if not watch:
                        sys.exit(2)
                    continue
                if as_json:
                    print(json.dumps(snap, sort_keys=True, default=float), flush=True)
                else:
                    console.print(render(snap))
                if not watch:
                    return
        finally:
            await snaps.aclose()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return

"""A dedicated bootstrap node: a DHT node (and libp2p relay) that trains nothing.

Swarms of hivemind and Petals usually start from such nodes: long-lived, on a public address, the
``--initial-peers`` of everyone. ``locomm-peer bootstrap`` runs one:

- P2P and a DHT node with the swarm's record validator (``peer/transport/records.py``): in a closed swarm
  (``--swarm-key``) it stores only records that carry the key; in an open one it stores any record, and
  every reader checks what it reads;
- with ``--config`` (or ``--preset``) it publishes that run spec under its own key and keeps it alive
  (every SPEC_TTL_S / 3), so joiners without --config can take it from this node; without one, the first
  peer that joins through it with ``--config`` publishes its spec (``peer/spec_sync.py``) and joiners
  name that peer too, or bring the same --config.

It runs until SIGINT, SIGTERM or SIGHUP, then shuts the DHT and p2pd down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import time
from collections.abc import Callable

from locomm.atomic import atomic_write_text
from locomm.config import ConfigError, RunSpec
from locomm.peer.options import NodeOptions
from locomm.peer.transport import dht_clock, leftovers, reach
from locomm.peer.transport.records import SPEC_TTL_S, SwarmKey, SwarmValidator, load_identity
from locomm.peer.transport.swarm import publish_spec

__all__ = ["run_bootstrap"]

log = logging.getLogger(__name__)


async def run_bootstrap(
    opts: NodeOptions, spec: RunSpec | None, *, on_up: Callable[[str, list[str]], None] | None = None
) -> None:
    """Serve as a bootstrap node until a stop signal (see the module docstring); ``on_up(peer id, maddrs)``
    once it is reachable."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    key = SwarmKey.load(opts.swarm_key) if opts.swarm_key else None
    identity, tmp = reach.identity_path(opts, key)  # the peers' rules: a certificate needs its own identity
    initial = list(opts.initial_peers) or None
    p2p = dht = rec = clock = None
    try:
        leftovers.sweep()
        dht_clock.install()  # stores and expires records on the swarm's time (peer/transport/dht_clock.py)
        p2p = await reach.start_p2p(opts, identity, initial)  # a public relay: the relay guard the peers get
        rec = leftovers.record(p2p)
        me = p2p.peer_id.to_base58()
        validator = SwarmValidator(load_identity(identity), swarm_key=key, clock=dht_clock.now)
        if validator.peer_id != me:
            raise ConfigError(f"the identity {identity} is not the key p2pd runs with")
        if spec is not None:
            validator.set_run(spec.hash()[:16], spec.network.heartbeat_ttl_s)
        dht = await reach.create_dht(p2p, initial, validator)  # an initial peer's clock off: joins anyway
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        if opts.announce_file:
            atomic_write_text(opts.announce_file, "\n".join(maddrs) + "\n")
        what = f"run spec {spec.hash()[:12]}" if spec is not None else "no run spec (joiners bring --config)"
        log.info("bootstrap node %s up with %s; peers join with --initial-peers %s", me, what, maddrs[0])
        if on_up is not None:
            on_up(me, maddrs)
        stored = -float("inf")
        clock = asyncio.create_task(dht_clock.keep(dht, stop))
        while not stop.is_set():
            if spec is not None and time.monotonic() - stored > SPEC_TTL_S / 3:
                try:
                    await publish_spec(dht, me, spec, key)
                    stored = time.monotonic()
                except Exception as e:  # a missed refresh is retried next time
                    log.warning("storing the run spec failed: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(5.0, SPEC_TTL_S / 6))
    finally:
        if clock is not None:
            clock.cancel()
            with contextlib.suppress(BaseException):
                await clock
        for svc in (dht, p2p):
            if svc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(svc.shutdown(), 10)
        if p2p is not None:
            leftovers.forget(rec, p2p)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

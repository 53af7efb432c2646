"""Reaching the swarm: the identity, p2pd, the record validator and the DHT node.

A start through ``--initial-peers`` is tried again when it fails (an initial peer on a slow link, or dying, fails
p2pd's bootstrap or the DHT's ping back), as long as ``peer_cache.retry_in`` says: about 40 s for a first join,
minutes for a restart that remembers peers it trained with. Then it is a one-line error, not a traceback.

A stop signal ends it at once, as a stop (:class:`Stopped`, ``join`` exits 0): between two tries, and during a
try too. A try is cut where it is and the p2pd it started is stopped. Chaos seed 14's final stop waited 27.6 s
for a try that was in flight when the signal came.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.protocol import ValidationError as DHTValidationError
from hivemind.p2p import P2P

from locomm.config import ConfigError, RunSpec
from locomm.peer.options import NodeOptions
from locomm.peer.transport import dht_clock, leftovers, p2pd_calls, peer_cache, relay_check
from locomm.peer.transport.records import SwarmKey, SwarmValidator, load_identity, peer_id_of, public_der
from locomm.peer.transport.swarm import peer_ids_of

__all__ = ["RELAY_STARTS", "Reached", "Stopped", "identity_path", "reach"]

log = logging.getLogger(__name__)
RELAY_STARTS = 4
"""p2pd starts a ``--reachability public`` peer tries for its full relay service (with one Go thread each start
has won it in every measured start so far: 22 of 22, docs/results/nat.md)."""
P2PD_STOP_S = 10.0
"""How long a p2pd that a failed or cut try started gets to exit after SIGTERM, before SIGKILL."""


class Stopped(Exception):
    """A signal came before the peer reached the swarm: it leaves with nothing to hand over (exit 0)."""


@dataclass
class Reached:
    """What a successful try hands the host."""

    p2p: P2P
    dht: DHTNode
    validator: SwarmValidator
    me: str
    maddrs: list[Any]
    record: Path | None
    """p2pd's record (``leftovers.record``): removed on exit, or by the next start after a kill."""


_STARTED: contextvars.ContextVar[list[P2P] | None] = contextvars.ContextVar("locomm_started_p2pd", default=None)


def _note_new_p2p() -> None:
    """Note each hivemind P2P in the current try's list as soon as it exists (idempotent): ``P2P.create`` builds
    the instance before it starts p2pd and returns it only once p2pd answers, and a relay check builds probe
    nodes of its own (``relay_check.probe``), so a try cut inside one would otherwise leave a p2pd that nobody
    holds running. Outside a try (no list in the context) nothing is noted."""
    init = P2P.__init__
    if getattr(init, "_locomm_noted", False):
        return

    @functools.wraps(init)
    def noted(self: P2P, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        started = _STARTED.get()
        if started is not None:
            started.append(self)

    noted._locomm_noted = True  # type: ignore[attr-defined]
    P2P.__init__ = noted  # type: ignore[method-assign]


def identity_path(opts: NodeOptions, swarm_key: SwarmKey | None) -> tuple[Path, Path | None]:
    """The identity file P2P runs with, and the folder to remove at exit when it is a throwaway one.

    The user's ``--identity``, else a fresh key in a private (0700) temp folder: P2P always runs with a key
    this peer holds, since that key signs every record it writes."""
    cert = swarm_key.certificate if swarm_key is not None else None
    if opts.identity is not None:
        if opts.identity.exists():
            key = load_identity(opts.identity)  # an unusable key fails here, before p2pd starts
            if swarm_key is not None:
                swarm_key.check_identity(peer_id_of(public_der(key)))
        elif cert is not None:
            raise ConfigError(
                f"--identity {opts.identity}: no such file, and the admission certificate "
                f"names peer {cert.peer}: pass the identity file the founder admitted"
            )
        return opts.identity, None
    if cert is not None:
        raise ConfigError(
            f"the admission certificate names peer {cert.peer}: pass --identity with that peer's "
            "key file (a peer without --identity gets a new id every start)"
        )
    folder = Path(tempfile.mkdtemp(prefix="locomm-id-"))  # mkdtemp: mode 0700
    return folder / "identity.key", folder  # P2P.create generates it (and skips the "is it taken" check)


async def reach(
    opts: NodeOptions,
    spec: RunSpec,
    identity: Path,
    swarm_key: SwarmKey | None,
    *,
    boot: list[str] | None,
    known: bool,
    stop: asyncio.Event,
    on_event: Callable[..., None] | None = None,
) -> Reached:
    """P2P, the validator and the DHT node, tried again through ``--initial-peers`` (see the module docstring).

    ``boot``: the addresses to bootstrap through (the user's, then on a restart the peers it saw last);
    ``known``: this run's keys are guarded from the start (the spec is the user's, or this is the first peer).
    Raises :class:`Stopped` once ``stop`` is set, ConfigError when it gives up."""
    initial = list(opts.initial_peers) or None
    boot = boot or initial
    t0, remembered = time.monotonic(), bool(set(boot or ()) - set(initial or ()))  # peers it trained with
    plan = _Plan(opts, spec, identity, swarm_key, boot, known, on_event)
    for attempt in itertools.count():
        try:
            return await _unless_stopped(_try(plan), stop)
        except (ConfigError, Stopped, asyncio.CancelledError):
            raise
        except Exception as e:  # p2pd's "failed to connect to bootstrap peers", DHT's ValidationError, ...
            if not initial:
                raise
            wait = peer_cache.retry_in(attempt, time.monotonic() - t0, remembered)
            if wait is not None and not stop.is_set():
                log.warning("reaching the swarm failed (%s: %s); again in %.0f s", type(e).__name__, e, wait)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set():  # Ctrl-C while it tried: not an error (a chaos final stop read exit 2)
                raise Stopped("stopped before reaching the swarm") from e
            if wait is None:
                raise ConfigError(f"cannot reach the swarm through --initial-peers: {type(e).__name__}: {e}") from e
    raise AssertionError("unreachable")  # pragma: no cover


async def _unless_stopped(coro: Coroutine[Any, Any, Reached], stop: asyncio.Event) -> Reached:
    """``coro``'s result, or :class:`Stopped` as soon as ``stop`` is set: ``coro`` is then cancelled and awaited (a
    try stops what it started before this returns). A cancel from outside is passed on to the try the same way,
    and raised; a try that finished all the same (its result came in the same instant) is closed."""
    task = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cut(task)
        raise
    finally:
        stopped.cancel()
    if not task.done():
        await _cut(task)
        raise Stopped("stopped before reaching the swarm")
    return task.result()


async def _cut(task: asyncio.Future[Reached]) -> None:
    """Cancel a try and wait for it to clean up (a second cancel of ours stops the wait, not its clean-up); close
    what it reached if it finished first."""
    task.cancel()
    await asyncio.wait({task})  # never cancels ``task`` again
    if not task.cancelled() and task.exception() is None:
        await asyncio.shield(_close(task.result()))


async def _close(got: Reached) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(got.dht.shutdown(), P2PD_STOP_S)
    await _stop_all([got.p2p])


async def _stop_all(started: list[P2P]) -> None:
    for p in started:
        await _stop_p2pd(p)
        leftovers.forget(None, p)


@dataclass(frozen=True)
class _Plan:
    """What every try of one start uses (:func:`reach`'s arguments)."""

    opts: NodeOptions
    spec: RunSpec
    identity: Path
    swarm_key: SwarmKey | None
    boot: list[str] | None
    known: bool
    on_event: Callable[..., None] | None


async def _try(plan: _Plan) -> Reached:
    """One try. Whatever ends it early (an error, a cancel) stops every p2pd it started first."""
    opts, spec, identity, boot = plan.opts, plan.spec, plan.identity, plan.boot
    started: list[P2P] = []
    _STARTED.set(started)  # this task's own context (and the tasks it starts): what _note_new_p2p fills
    _note_new_p2p()
    try:
        p2p = await start_p2p(opts, identity, boot, plan.on_event)
        record = leftovers.record(p2p)
        me = p2p.peer_id.to_base58()
        validator = SwarmValidator(load_identity(identity), swarm_key=plan.swarm_key, clock=dht_clock.now)
        if validator.peer_id != me:
            raise ConfigError(f"the identity {identity} is not the key p2pd runs with")
        for peer in peer_ids_of(opts.initial_peers):
            validator.trust(peer)
        if plan.known:
            validator.set_run(spec.hash()[:16], spec.network.heartbeat_ttl_s)
        maddrs = await p2p.get_visible_maddrs()
        dht = await create_dht(p2p, boot, validator)
        return Reached(p2p, dht, validator, me, maddrs, record)
    except BaseException:
        await asyncio.shield(_stop_all(started))  # a second cancel does not leave any running either
        raise


async def _stop_p2pd(p2p: P2P) -> None:
    """Stop the p2pd of a failed or cut try: SIGTERM, then SIGKILL after ``P2PD_STOP_S``."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(p2p.shutdown(), P2PD_STOP_S)
    child = getattr(p2p, "_child", None)  # hivemind's asyncio Process of p2pd
    if child is not None and child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(child.wait(), P2PD_STOP_S)


async def create_dht(p2p: P2P, initial: list[str] | None, validator: SwarmValidator) -> DHTNode:
    """The DHT node on our P2P. hivemind's bootstrap (strict) checks that an initial peer answers, can reach
    us back and keeps our time within 3 s; the last alone is not ours to enforce: one initial peer whose
    clock is off (an NTP step, a wrong RTC: benchmarks/chaos.py's clock_step) kept every newcomer that named
    it out of the swarm. Our records are checked against each reader's own clock (peer/transport/records.py),
    so then the node is created again, on the same P2P, without that check."""
    try:
        return await DHTNode.create(p2p=p2p, initial_peers=initial, record_validator=validator)
    except DHTValidationError as e:
        if "local time" not in str(e):
            raise
        log.warning("the initial peer's clock differs from ours by over 3 s (%s); joining anyway", e)
    # the failed node's protocol handlers are still registered on the P2P (hivemind leaves them): remove them
    # (remove_p2p_handlers reads only the class's handler table)
    await DHTProtocol.remove_p2p_handlers(DHTProtocol.__new__(DHTProtocol), p2p)
    return await DHTNode.create(p2p=p2p, initial_peers=initial, record_validator=validator, strict=False)


async def start_p2p(
    opts: NodeOptions, identity: Path, boot: list[str] | None, on_event: Callable[..., None] | None = None
) -> P2P:
    """hivemind's P2P (p2pd). A relaying node that says it is public (``--reachability public``) first checks
    which circuit-relay service its p2pd serves with, and restarts p2pd (same identity) while it is the one
    limited to 128 KiB per relayed connection, at most ``RELAY_STARTS`` times; its p2pd runs one Go thread,
    which settles the race in hivemind 1.1.12's p2pd for the wide one (peer/transport/relay_check.py; an open
    peer left to AutoNAT has the limited one only until AutoNAT says public)."""

    p2pd_calls.install()  # a late answer to a cancelled call must not silence the control client

    async def create() -> P2P:
        return await P2P.create(
            initial_peers=boot,  # the user's --initial-peers, and on a restart the peers it saw last
            identity_path=str(identity),
            **opts.p2p_kwargs(opts.initial_peers),  # addresses, relays (the user's), auto-relay, reachability
        )

    if opts.reachability != "public" or not opts.relay:
        return await create()
    return await relay_check.start_checked(create, on_event or (lambda *a, **k: None), RELAY_STARTS)

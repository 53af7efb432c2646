"""hivemind's p2pd control client, guarded against an answer that arrives for a call its caller gave up on.

hivemind 1.1.12's ``ControlClient`` keeps each unary call's future in ``_pending_calls`` until the caller's
``finally`` removes it. A caller cancelled by a timeout leaves its cancelled future there until its task next
runs, a later turn of the loop; if the daemon's answer to that call is read in between, the client's one reader
task calls ``set_result`` (or ``set_exception``) on a cancelled future, raises ``InvalidStateError`` and ends.
From then on no unary call of the process is answered: every DHT request it makes times out. Chaos seed 16 met
it (``docs/results/chaos.md``: "unretrieved: InvalidStateError" from ``_read_from_persistent_conn`` in a peer's
stderr), at the peer's exit; under load the same window is open at any time a call times out.

The guard: a finished future is not a pending call. The reader asks ``call_id in _pending_calls`` before it sets
anything, so with :class:`_LiveCalls` it skips an answer nobody waits for (hivemind logs it at debug level).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["install"]

log = logging.getLogger(__name__)
_installed = False


class _LiveCalls(dict):
    """``_pending_calls`` whose ``in`` is false for a call whose future is done (its caller was cancelled)."""

    def __contains__(self, key: object) -> bool:
        fut = self.get(key)
        return fut is not None and not fut.done()


def install() -> bool:
    """Guard every ``ControlClient`` made from now on (idempotent); False when hivemind's layout changed."""
    global _installed
    if _installed:
        return True
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient  # noqa: PLC0415

    init = ControlClient.__init__

    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        calls = getattr(self, "_pending_calls", None)
        if type(calls) is dict:
            self._pending_calls = _LiveCalls(calls)

    if not callable(init) or "_read_from_persistent_conn" not in ControlClient.__dict__:
        log.warning("hivemind's ControlClient changed: its pending calls are not guarded")
        return False
    ControlClient.__init__ = guarded  # type: ignore[method-assign]
    _installed = True
    return True

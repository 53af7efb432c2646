"""An event loop on virtual time, for deadline tests that must not sleep on the real clock.

``VirtualTimeLoop`` is an ordinary selector event loop whose ``time()`` is a number the loop
moves itself: whenever it has nothing ready to run, nothing on the real selector, and no work
outstanding in executor threads, it jumps to its next timer. So ``await asyncio.sleep(1000)``
returns at once with ``loop.time()`` 1000 s later, and ``asyncio.timeout`` / ``wait_for``
fire at exact virtual instants: a test asserts ``cut == 0.5`` rather than ``0.4 <= cut <= 5``.

Notable:
- **Executor work is never jumped over.** The codec pool decodes in threads; a thread's job
  takes real time but no virtual time. While any future from ``run_in_executor`` (including
  ``asyncio.to_thread``) is unfinished in its thread, virtual time stands still and the loop
  waits on the real selector; a job's end wakes it through ``call_soon_threadsafe``. A job whose
  asyncio future was cancelled while it runs still holds time until its thread returns.
  Threads started any other way (``executor.submit`` + ``asyncio.wrap_future``) are not seen.
- **Real I/O still works**: the real selector is polled before every jump, and with no timer
  at all the loop blocks on it as a normal loop does (a test timeout catches a deadlock). I/O
  that is not ready yet does not hold the clock, though: with a timer pending, the loop jumps.
- Code under test must read the loop's clock: the RPC layer and Gossip take
  ``clock=asyncio.get_running_loop().time``.

Use ``run(coro)`` in place of ``asyncio.run(coro)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["VirtualTimeLoop", "run"]

T = TypeVar("T")


class _VirtualSelector(selectors.BaseSelector):
    """The real selector, except that a wait with nothing to wait for becomes a jump of the loop's clock."""

    def __init__(self, loop: VirtualTimeLoop, real: selectors.BaseSelector) -> None:
        self.loop, self.real = loop, real

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # The loop asks for timeout 0 whenever callbacks are ready; > 0 means it is idle until its next timer.
        if timeout is not None and timeout <= 0:
            return self.real.select(0)
        if self.loop.in_executor:  # threads are working: time stands still until one of them reports back
            return self.real.select(None)
        events = self.real.select(0)
        if events or timeout is None:  # I/O is ready, or there is no timer to jump to: a real wait
            return events or self.real.select(None)
        self.loop.advance(timeout)
        return []

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self.real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self.real.get_map()

    def close(self) -> None:
        self.real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock advances only when nothing can run (see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self.in_executor = 0
        """Jobs submitted through ``run_in_executor`` whose thread has not finished with them."""
        super().__init__(_VirtualSelector(self, selectors.DefaultSelector()))
        self._default_pool: Executor = ThreadPoolExecutor(thread_name_prefix="virtual-loop")
        super().set_default_executor(self._default_pool)

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the loop does this itself when idle; a test may too)."""
        if seconds < 0:
            raise ValueError("virtual time does not run backwards")
        self._now += seconds

    def set_default_executor(self, executor: Any) -> None:
        super().set_default_executor(executor)
        self._default_pool = executor

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        job = (executor or self._default_pool).submit(func, *args)
        fut = asyncio.wrap_future(job, loop=self)
        self.in_executor += 1
        # Registered after wrap_future's own callback: the thread hands the loop the result first, then the
        # count, so when the count drops the waiter is already woken (ready), and the loop never sees a moment
        # with the job done, the count at zero and its result still on the way.
        job.add_done_callback(self._job_done)
        return fut

    def _job_done(self, _: Future) -> None:
        # Runs in the worker thread (or here, for a job cancelled before it started): hand it to the loop.
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
            self.call_soon_threadsafe(self._count_done)

    def _count_done(self) -> None:
        self.in_executor -= 1


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool | None = None) -> T:
    """``asyncio.run(main)`` on a fresh ``VirtualTimeLoop`` whose clock reads ``start``."""
    with asyncio.Runner(debug=debug, loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(main)

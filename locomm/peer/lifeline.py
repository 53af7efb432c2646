"""No process outlives its parent: parent-death signals for peers, p2pd and forked helpers, and a reaper
for a local swarm's peers and temporary folder.

Three pieces (Linux; elsewhere the first two are no-ops and only the reaper's pid list is left):

- :func:`pdeath_argv` wraps a command in a tiny exec shim (``python -I -S -c``) that sets
  ``prctl(PR_SET_PDEATHSIG)`` and then execs the command. The setting survives execve, so the command
  gets the signal the moment its parent dies. The shim first checks that its parent is still the process
  that started it (the parent may have died before the prctl) and resets SIGPIPE (which Python ignores
  and execve would keep ignored) and SIGINT (which a shell's background job ignores, while the launcher
  stops its peers with SIGINT). Chosen over ``setpriv --pdeathsig``: setpriv is util-linux >= 2.33
  only (absent from busybox and many slim images) and cannot make the parent check; sys.executable is
  always there, for ~20 ms per start.
- :func:`install` (once per peer process, from ``cli/daemon.py``). hivemind's ``P2P.create`` builds the
  p2pd command with the staticmethod ``P2P._make_process_args``; wrapping it puts every p2pd behind the
  shim, in a process group of its own (the peer stops it after its goodbye), without touching hivemind's
  files: the node's own, and that of DiLoCo's forked ``hivemind.DHT``
  (the wrapper is inherited through fork). It also registers a multiprocessing after-fork hook, so each
  ``multiprocessing`` fork child (hivemind.DHT, DecentralizedAverager) is SIGKILLed when its parent
  dies. PR_SET_PDEATHSIG fires when the parent *thread* exits, not the process: a child forked from the
  main thread gets it (locomm forks DiLoCo's helpers and spawns p2pd from the loop, on the main thread);
  one forked from another thread, which may end long before the process, gets a watcher thread that
  polls ``getppid()`` instead. The peer itself gets SIGTERM (a clean stop) from the launcher's shim.
- :class:`Reaper`: a small process (``python -m locomm.peer.lifeline PREFIX GRACE``) holding the read end
  of a pipe whose write end only the launcher holds: the lifeline. It creates the swarm's temporary folder
  (so the folder never exists without someone owning its removal), learns each peer's pid through the
  pipe, and on EOF (the launcher exited: cleanly, on an exception, or SIGKILLed) stops what is left:
  SIGTERM to each peer's process group, ``grace_s``, then SIGKILL to those groups and to every process
  carrying the swarm's marker (:data:`MARKER` in its environment, which p2pd and forks inherit); then it
  removes the folder. It sits in a session of its own and ignores SIGINT and SIGHUP, so the terminal's
  Ctrl-C or hang-up reaches the launcher only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from locomm.peer.transport import leftovers

__all__ = ["MARKER", "Reaper", "install", "marked", "pdeath_argv", "set_pdeathsig"]

log = logging.getLogger(__name__)

MARKER = "LOCOMM_SWARM_DIR"
"""Environment variable set to a local swarm's folder in each of its peers (so p2pd and forks carry it)."""

LINUX = sys.platform.startswith("linux")
PR_SET_PDEATHSIG = 1

# argv: SIG PPID GROUP PROGRAM ARGS...; exits 1 if the parent that started it has gone already; GROUP "1": the
# program gets a process group of its own.
_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,int(sys.argv[1]),0,0,0)\n"
    "os.getppid()==int(sys.argv[2]) or os._exit(1)\n"
    "sys.argv[3]=='1' and os.setpgid(0,0)\n"
    "signal.signal(signal.SIGPIPE,signal.SIG_DFL)\n"
    "signal.signal(signal.SIGINT,signal.SIG_DFL)\n"
    "os.execv(sys.argv[4],sys.argv[4:])\n"
)


def set_pdeathsig(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits (Linux only)."""
    if not LINUX:
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def pdeath_argv(
    argv: Sequence[str], sig: int = signal.SIGTERM, parent: int | None = None, *, own_group: bool = False
) -> list[str]:
    """``argv`` behind the exec shim: the command gets ``sig`` when ``parent`` (default: this process,
    or rather the thread that will spawn it) dies; with ``own_group`` it leaves its parent's process group
    (signals sent to that group, a terminal's Ctrl-C among them, no longer reach it). Unchanged off Linux.
    ``argv[0]`` must be a path."""
    if not LINUX:
        return list(argv)
    ppid = os.getpid() if parent is None else parent
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(int(sig)), str(ppid), "1" if own_group else "0", *argv]


# -- the per-process installation: p2pd behind the shim, fork children with a parent-death signal ----

_installed = False
_forker = {"pid": 0, "main": True}  # who is forking: read in the child, where memory is a copy


class _Hook:
    """The object multiprocessing's after-fork registry holds (weakly: this module keeps it alive)."""


_HOOK = _Hook()


def _before_fork() -> None:
    _forker.update(pid=os.getpid(), main=threading.current_thread() is threading.main_thread())


def _watch_parent(ppid: int) -> None:
    while os.getppid() == ppid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _child_signals() -> None:
    """A fork child's signals, apart from its parent's: the parent's event loop handles SIGINT and SIGTERM by
    writing the signal number into its wakeup socket, and a fork inherits both the handlers and that socket. A
    child then ignored SIGTERM (hivemind's ``terminate()`` of its DHT did nothing: a DiLoCo peer's exit hung for
    good on multiprocessing's join of that child, seen once in a suite run), and each signal it got reached the
    parent's loop a second time (one Ctrl-C read as two: "leave at once"). So: SIGTERM as the default (it ends
    the child), SIGINT ignored (the parent stops its helpers; a terminal's Ctrl-C is the parent's), no wakeup fd."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _after_fork(_: object) -> None:
    _child_signals()
    ppid = _forker["pid"] or os.getppid()
    if _forker["main"]:
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != ppid:  # the parent died before the prctl
            os._exit(1)
    else:  # the forking thread may end before its process: watch the process instead
        threading.Thread(target=_watch_parent, args=(ppid,), daemon=True, name="lifeline").start()


def _shimmed(make: Callable[..., list[str]]) -> Callable[..., list[str]]:
    @functools.wraps(make)
    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        argv = make(*args, **kwargs)
        if not argv or os.path.basename(argv[0]) != "p2pd":
            return argv
        leftovers.record_spawn(kwargs.get("listen"))  # before it runs: a kill from here on leaves a record
        # p2pd in a process group of its own: a Ctrl-C in the peer's terminal (SIGINT to the foreground group)
        # or a stop sent to the peer's group reaches the peer alone, which finishes its exchange, says goodbye
        # through p2pd, then stops it. When p2pd shared the group it died with the signal: the last exchange
        # broke, no goodbye went out, and the DHT's shutdown waited 10 s on the dead daemon.
        return pdeath_argv(argv, own_group=True)

    return make_process_args


def install() -> bool:
    """Give every p2pd this process (or its forks) starts SIGTERM, and every multiprocessing fork child
    SIGKILL, when their parent dies. Idempotent; False off Linux or when hivemind's hook point is gone."""
    global _installed
    if _installed or not LINUX:
        return _installed
    from hivemind.p2p.p2p_daemon import P2P  # noqa: PLC0415 - only peers need it

    make = P2P.__dict__.get("_make_process_args")
    if not isinstance(make, staticmethod):
        log.warning("hivemind's P2P._make_process_args is gone: p2pd gets no parent-death signal")
        return False
    P2P._make_process_args = staticmethod(_shimmed(make.__func__))  # type: ignore[method-assign]
    os.register_at_fork(before=_before_fork)
    multiprocessing.util.register_after_fork(_HOOK, _after_fork)
    _installed = True
    return True


# -- the reaper -------------------------------------------------------------------------------------


def marked(value: str, *, name: str = MARKER) -> list[int]:
    """Live processes (not zombies) whose environment has ``name=value``; [] off Linux."""
    if not LINUX:
        return []
    needle = f"\0{name}={value}\0".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in b"\0" + Path(f"/proc/{d}/environ").read_bytes() + b"\0":
                out.append(int(d))
    return out


def _signal(groups: Iterable[int], pids: Iterable[int], sig: int) -> None:
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, sig)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _groups(pids: Iterable[int]) -> list[int]:
    """Those of the process groups ``pids`` that still have a live member (zombies do not count)."""
    pids = set(pids)
    if not LINUX:
        out = []
        for g in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, 0)
                out.append(g)
        return out
    live = set()
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
            if fields[0] not in "ZX" and int(fields[2]) in pids:
                live.add(int(fields[2]))
    return sorted(live)


def stop_swarm(folder: str, groups: set[int], grace_s: float) -> None:
    """SIGTERM to the peers (the groups' leaders: each stops its own p2pd and helpers); after ``grace_s``
    (or once none is left), SIGKILL to whatever is left of their groups and of every process marked with
    ``folder``; wait up to 5 s for them to go."""
    _signal((), groups, signal.SIGTERM)
    for sig, wait_s in ((None, grace_s), (signal.SIGKILL, 5.0)):
        if sig is not None:
            _signal(_groups(groups), marked(folder), sig)
        deadline = time.monotonic() + wait_s
        while (_groups(groups) or marked(folder)) and time.monotonic() < deadline:
            time.sleep(0.1)


def _reap(prefix: str, grace_s: float) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        print(folder, flush=True)
        sys.stdout.close()
        groups: set[int] = set()
        for line in sys.stdin:  # until EOF: the launcher has exited, however it did
            with contextlib.suppress(ValueError):
                (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
        stop_swarm(folder, groups, grace_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Reaper:
    """The launcher's end of the lifeline: a context manager that starts the reaper process, which makes
    the temporary folder :attr:`folder`; :meth:`watch` and :meth:`forget` tell it each peer's pid. On exit
    (or when this process dies) the pipe closes: the reaper stops what is left and removes the folder."""

    def __init__(self, prefix: str, *, grace_s: float = 8.0) -> None:
        self.prefix = prefix
        self.grace_s = grace_s
        self.folder = Path()
        self._proc: subprocess.Popen | None = None
        self._pipe: Any = None

    def __enter__(self) -> Reaper:
        r, w = os.pipe()  # both ends non-inheritable: no peer ever holds the write end
        self._pipe = os.fdopen(w, "w", buffering=1)
        try:
            cmd = [sys.executable, "-m", "locomm.peer.lifeline", self.prefix, str(self.grace_s)]
            self._proc = subprocess.Popen(cmd, stdin=r, stdout=subprocess.PIPE, start_new_session=True, text=True)
        finally:
            os.close(r)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        self._proc.stdout.close()
        if not line:
            self.__exit__()
            raise RuntimeError("the reaper did not start")
        self.folder = Path(line)
        return self

    def _send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # the reaper gone: nothing to tell
            self._pipe.write(line + "\n")

    def watch(self, pid: int) -> None:
        """Stop the process group ``pid`` if the launcher dies."""
        self._send(f"+{pid}")

    def forget(self, pid: int) -> None:
        """The group ``pid`` has been stopped and waited for (its pid may be reused)."""
        self._send(f"-{pid}")

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(OSError):
            self._pipe.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=self.grace_s + 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    _reap(sys.argv[1], float(sys.argv[2]))

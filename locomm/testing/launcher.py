"""One launcher of `locomm-peer join` subprocesses, for tests and benchmarks.

A :class:`Launcher` owns every peer it starts and stops them all when it closes (a context
manager, so that happens in ``finally``). Each peer:

- runs ``python -m locomm.cli.main join ...`` in a session (process group) of its own, so its
  p2pd, which shares the group, is stopped with it even when the peer itself was SIGKILLed;
- optionally inside a host wrapper: a command prefix (``host.argv([])`` of
  :class:`locomm.testing.netlab.Host`, ``["unshare", "-n"]``) or a ``spawn`` callable
  (``host.popen``, which also registers the process with the netlab lab);
- logs JSON-lines events to ``<folder>/<name>.jsonl``, stdout to ``<name>.out``, stderr to
  ``<name>.err``, and writes its real multiaddrs (it binds port 0) to ``<name>.addr``;
- is stopped with ``stop_signal`` (SIGTERM by default; the daemon treats it as SIGINT: finish the
  step, checkpoint, shut P2P down), then SIGKILL to its whole group after ``grace_s``.

Runtime code never imports this module::

    with Launcher(tmp_path) as peers:
        a = peers.start("a", "--until-round", "3", config=cfg)
        b = peers.start("b", "--until-round", "3", config=cfg, initial_peers=a.address())
        assert a.wait(240) == 0, a.tail()
        print(b.events("finished"))
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from locomm.cli.swarm_view import read_events
from locomm.peer.options import local_defaults

Spawn = Callable[..., subprocess.Popen]
"""``spawn(argv, **popen_kwargs) -> Popen``: how a peer's command is started (default ``subprocess.Popen``)."""


class PeerExited(RuntimeError):
    """A peer exited while we waited for it to come up."""


@dataclass
class PeerProcess:
    """One `locomm-peer join` subprocess and the files it writes."""

    name: str
    proc: subprocess.Popen
    log: Path
    """Its JSON-lines event log (``--log-file``)."""
    addr: Path | None
    """Its announce file (``--announce-file``), or None when it was started without one."""
    weights: Path | None
    """Its final weights (``--final-weights``), or None."""
    out: Path
    err: Path
    stop_signal: int = signal.SIGTERM
    grace_s: float = 10.0
    started_at: float = field(default_factory=time.time)
    """Wall-clock time just before the process was started."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit (``subprocess.TimeoutExpired`` after ``timeout``); its exit code."""
        return self.proc.wait(timeout=timeout)

    def tail(self, chars: int = 3000) -> str:
        """The end of its stderr (for assertion messages)."""
        try:
            return self.err.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def addresses(self, timeout: float = 90.0) -> list[str]:
        """Its announced multiaddrs, waiting up to ``timeout`` s for the announce file.

        Raises:
            PeerExited: the process exited first (with its stderr's tail).
            TimeoutError: no address within ``timeout``.
        """
        if self.addr is None:
            raise ValueError(f"peer {self.name} was started without an announce file")
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                text = self.addr.read_text().strip()
                if text:
                    return text.split()
            if self.proc.poll() is not None:
                raise PeerExited(f"peer {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.name} did not come up in {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def address(self, timeout: float = 90.0, *, ip: str | None = None) -> str:
        """Its first announced multiaddr (with ``ip``: the first one on that IPv4 address)."""
        addrs = self.addresses(timeout)
        if ip is None:
            return addrs[0]
        for a in addrs:
            if f"/ip4/{ip}/" in a:
                return a
        raise RuntimeError(f"peer {self.name} announced no address on {ip}: {addrs}")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The events of its log so far (all, or those of one ``kind``); a half-written line is skipped."""
        ev = read_events(self.log)
        return ev if kind is None else [e for e in ev if e.get("event") == kind]

    def round(self) -> int:
        """The round counter of its last "round" event (0 before the first)."""
        rounds = self.events("round")
        return rounds[-1]["round"] if rounds else 0

    def send_signal(self, sig: int, *, group: bool = False) -> None:
        """Signal the peer process alone, or (``group``) its whole process group, p2pd included."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)

    def kill(self, *, group: bool = False) -> None:
        """SIGKILL the peer process (its p2pd is orphaned, as after a crash) or its whole group."""
        self.send_signal(signal.SIGKILL, group=group)

    def stop(self, grace_s: float | None = None) -> int | None:
        """``stop_signal`` to its group, up to ``grace_s`` to exit, then SIGKILL to whatever is left of the
        group (an orphaned p2pd too); idempotent. Returns the exit code (None if it could not be reaped)."""
        _stop([self], self.grace_s if grace_s is None else grace_s)
        return self.proc.returncode

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop(peers: Sequence[PeerProcess], grace_s: float) -> None:
    """Stop several peers at once: one shared grace period, not one each."""
    for p in peers:
        if p.proc.poll() is None:
            p.send_signal(p.stop_signal, group=True)
    deadline = time.monotonic() + grace_s
    for p in peers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in peers:  # always: the group outlives a peer that was SIGKILLed alone
        p.send_signal(signal.SIGKILL, group=True)
    for p in peers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=10)


class Launcher:
    """Starts `locomm-peer join` subprocesses into one folder and stops all of them on close."""

    def __init__(
        self,
        folder: str | Path,
        *,
        grace_s: float = 10.0,
        stop_signal: int = signal.SIGTERM,
        threads: int | None = 1,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        python: str = sys.executable,
    ) -> None:
        """Args:
        folder: Where every peer's log, announce file, weights, stdout and stderr go (created).
        grace_s: Seconds a peer gets to exit after ``stop_signal`` before SIGKILL.
        stop_signal: The polite stop (SIGTERM; SIGINT is the same to the daemon).
        threads: ``OMP_NUM_THREADS`` of every peer (None: inherited).
        env: Extra environment of every peer (over ``os.environ``).
        cwd: Working directory of every peer (default: inherited).
        python: The interpreter that runs ``-m locomm.cli.main``.
        """
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.stop_signal = stop_signal
        self.threads = threads
        self.env = dict(env or {})
        self.cwd = cwd
        self.python = python
        self.peers: list[PeerProcess] = []

    def command(self, *args: str) -> list[str]:
        """The argv of ``locomm-peer join *args`` with this launcher's interpreter."""
        return [self.python, "-m", "locomm.cli.main", "join", *args]

    def start(
        self,
        name: str,
        *args: str,
        config: str | Path | None = None,
        initial_peers: str | Sequence[str] | None = None,
        device: str | None = "cpu",
        announce: bool = True,
        weights: bool = False,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        spawn: Spawn | None = None,
    ) -> PeerProcess:
        """Start one peer; it is stopped when this launcher closes.

        Args:
            name: The peer's name: its files are ``<folder>/<name>.{jsonl,addr,safetensors,out,err}``.
            *args: More ``join`` arguments (``--until-round 3``, ``--shard 0/2``, ...).
            config: ``--config`` (a run spec TOML), if any.
            initial_peers: ``--initial-peers`` (one multiaddr or several), if any.
            device: ``--device`` (None: not passed).
            announce: Pass ``--announce-file`` (needed for :meth:`PeerProcess.address`).
            weights: Pass ``--final-weights``.
            env: Extra environment of this peer (over the launcher's).
            prefix: Command prefix, e.g. ``host.argv([])`` for a netlab namespace.
            spawn: Starts the command instead of ``subprocess.Popen`` (e.g. ``host.popen``).
        """
        if any(p.name == name for p in self.peers):
            raise ValueError(f"a peer named {name!r} was started already")
        f = self.folder
        log, addr, wts = f / f"{name}.jsonl", f / f"{name}.addr", f / f"{name}.safetensors"
        cmd = self.command("--log-file", str(log))
        if config is not None:
            cmd += ["--config", str(config)]
        if device is not None:
            cmd += ["--device", device]
        if announce:
            cmd += ["--announce-file", str(addr)]
        if weights:
            cmd += ["--final-weights", str(wts)]
        cmd += list(args)
        if initial_peers:
            for m in [initial_peers] if isinstance(initial_peers, str) else initial_peers:
                cmd += ["--initial-peers", m]
        cmd += local_defaults(cmd)
        full_env = dict(os.environ)
        if self.threads is not None:
            full_env["OMP_NUM_THREADS"] = str(self.threads)
        full_env |= {**self.env, **(env or {})}
        out, err = f / f"{name}.out", f / f"{name}.err"
        t0 = time.time()
        with open(out, "w") as fo, open(err, "w") as fe:  # the child holds its own copies
            proc = (spawn or subprocess.Popen)(
                [*prefix, *cmd],
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=full_env,
                cwd=None if self.cwd is None else str(self.cwd),
            )
        peer = PeerProcess(
            name,
            proc,
            log,
            addr if announce else None,
            wts if weights else None,
            out,
            err,
            stop_signal=self.stop_signal,
            grace_s=self.grace_s,
            started_at=t0,
        )
        self.peers.append(peer)
        return peer

    def __getitem__(self, name: str) -> PeerProcess:
        return next(p for p in self.peers if p.name == name)

    def __iter__(self) -> Iterator[PeerProcess]:
        return iter(self.peers)

    def __len__(self) -> int:
        return len(self.peers)

    def running(self) -> list[PeerProcess]:
        """The peers whose process has not exited."""
        return [p for p in self.peers if p.proc.poll() is None]

    def close(self) -> None:
        """Stop every peer (one shared grace period); idempotent."""
        _stop(self.peers, self.grace_s)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_until(
    cond: Callable[[], Any], timeout: float, what: str, peers: Sequence[PeerProcess] = (), poll_s: float = 0.2
) -> None:
    """Poll ``cond`` until it is true; TimeoutError(``what``) after ``timeout`` s, and an AssertionError with its
    log tail as soon as one of ``peers`` exits non-zero."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in peers:
            assert p.poll() is None or p.returncode == 0, p.tail()
        time.sleep(poll_s)
    raise TimeoutError(what)

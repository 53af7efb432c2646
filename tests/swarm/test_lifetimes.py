"""No process outlives its parent: real launchers, real peers, real p2pd, killed at awkward moments.

Each test marks the processes it starts with an environment variable of its own (inherited by the
launcher's reaper, the peers, their p2pd and forks) and points TMPDIR at a folder of its own, then
asserts that nothing marked is left alive and that no swarm folder is left. Every wait polls for a
condition under a generous deadline (the machine may be busy); ``finally`` SIGKILLs whatever is still
marked, so a failing test leaves nothing behind either. The full matrix (SIGINT at 2, 6, 12 s, SIGHUP,
SIGKILL at 3 and 12 s, DiLoCo) is ``benchmarks/lifetimes.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.peer.lifeline import marked
from locomm.testing import procs as proctab
from locomm.testing.procs import cmdline

pytestmark = pytest.mark.timeout(240)

MARK = "LOCOMM_LIFETIME_TEST"


def small_spec(path: Path) -> Path:
    spec = RunSpec.preset("nano").replace("data", batch_size=8, seq_len=64, max_corpus_mb=1.0)
    spec.replace("outer", algo="noloco").save(path)
    return path


def _comm(pid: int) -> str:
    return p.comm if (p := proctab.stat(pid)) else ""


def _ppid(pid: int) -> int:
    return p.ppid if (p := proctab.stat(pid)) else 0


def poll(cond: Callable[[], object], timeout_s: float, what: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what() if callable(what) else what}")
        time.sleep(0.1)


class Marked:
    """The processes of one test: started with ``MARK=<token>`` and ``TMPDIR=<tmp>/tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.token = uuid.uuid4().hex
        # A short TMPDIR (pytest's paths are long): the launcher gives its peers a TMPDIR inside the swarm
        # folder only when socket paths under it still fit (107 bytes).
        self.tmp = Path(tempfile.mkdtemp(prefix="lt-"))
        self.root = tmp

    def popen(self, args: list[str], name: str) -> subprocess.Popen:
        env = {**os.environ, MARK: self.token, "TMPDIR": str(self.tmp)}
        err = open(self.root / f"{name}.err", "w")  # noqa: SIM115 - the child holds it
        cmd = [sys.executable, "-m", "locomm.cli.main", *args]
        kw = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=self.root)
        return subprocess.Popen(cmd, start_new_session=True, **kw)

    def alive(self) -> list[int]:
        return marked(self.token, name=MARK)

    def peers(self) -> list[int]:
        """The `join` processes (not their forks, which share the command line)."""
        joins = [p for p in self.alive() if " join " in cmdline(p)]
        return [p for p in joins if _ppid(p) not in joins]

    def p2pd(self) -> list[int]:
        return [p for p in self.alive() if _comm(p) == "p2pd"]

    def folders(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("locomm-"))

    def describe(self) -> str:
        return ", ".join(f"{p}:{_comm(p)}" for p in self.alive()) or "none"

    def assert_gone(self, timeout_s: float = 30.0) -> None:
        poll(lambda: not self.alive(), timeout_s, lambda: f"every marked process gone; alive: {self.describe()}")
        poll(lambda: not self.folders(), 5.0, lambda: f"no swarm folder left: {self.folders()}")

    def kill_all(self) -> None:
        for pid in self.alive():
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Marked]:
    m = Marked(tmp_path)
    try:
        yield m
    finally:
        m.kill_all()
        shutil.rmtree(m.tmp, ignore_errors=True)


def test_sigkilled_peer_then_sigkilled_launcher_mid_start_up_leave_nothing(procs: Marked) -> None:
    """Data-parallel, two kills in one swarm (one peer start-up less on a busy machine):

    1. once the launcher has started the second peer, SIGKILL the first (the `join` process alone, not its
       group): its p2pd gets the parent-death signal;
    2. then, the second peer still starting, SIGKILL the launcher: the second peer, its p2pd, the reaper
       and the swarm folder all go."""
    spec = small_spec(procs.root / "run.toml")
    launcher = procs.popen(["swarm", "--peers", "2", "--rounds", "50", "--config", str(spec)], "launcher")
    try:
        poll(lambda: len(procs.peers()) >= 2 or launcher.poll() is not None, 120, "the second peer started")
        assert launcher.poll() is None, (procs.root / "launcher.err").read_text()
        assert procs.folders(), "the swarm folder exists while the launcher runs"
        first = min(procs.peers())
        daemons = [p for p in procs.p2pd() if _ppid(p) == first]
        assert daemons, f"the first peer runs a p2pd: {procs.describe()}"
        os.kill(first, signal.SIGKILL)
        poll(lambda: not set(daemons) & set(procs.alive()), 15, f"the first peer's p2pd {daemons} is gone")
        launcher.kill()
        launcher.wait()
        procs.assert_gone()
    finally:
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_sighup_of_a_pipeline_launcher_stops_it_cleanly(procs: Marked) -> None:
    """Pipeline 2x2: SIGHUP (the ssh session closing) is a clean stop: exit 0, no traceback, nothing left.

    Sent once the launcher has started its first peer (its handlers are installed by then). A running
    peer's own SIGHUP handling is the Host's; the benchmark sends SIGHUP at 6 s as well."""
    spec = small_spec(procs.root / "run.toml")
    args = ["swarm", "--pipeline", "2x2", "--rounds", "50", "--config", str(spec), "--json"]
    launcher = procs.popen(args, "launcher")
    try:
        poll(lambda: procs.peers() or launcher.poll() is not None, 90, "the first peer started")
        assert launcher.poll() is None, (procs.root / "launcher.err").read_text()
        launcher.send_signal(signal.SIGHUP)
        rc = launcher.wait(timeout=60)
        err = (procs.root / "launcher.err").read_text()
        assert rc == 0, err
        assert "Traceback" not in err, err
        procs.assert_gone(timeout_s=15)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_ctrl_c_to_a_peers_process_group_reaches_the_peer_alone_which_says_goodbye(procs: Marked) -> None:
    """A terminal's Ctrl-C is SIGINT to the whole foreground process group. p2pd sits in a group of its own
    (peer/lifeline.py), so the signal reaches the peer alone: it finishes its exchange, sends its goodbye through
    its still-running p2pd and stops it, well within the launcher's 10 s grace. When p2pd shared the group it died
    with the signal: the last push broke ("Connection lost"), the DHT's shutdown waited 10 s on the dead daemon,
    and the peer exited 17-31 s after the signal."""
    from locomm.testing.launcher import Launcher, wait_until

    spec = RunSpec.preset("nano").replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
    spec = spec.replace("outer", algo="noloco", inner_steps=5).replace("train", steps=100_000, eval_interval=0)
    cfg = procs.root / "run.toml"
    spec.replace("network", heartbeat_interval_s=1.0, heartbeat_ttl_s=4.0).save(cfg)
    env = {MARK: procs.token, "TMPDIR": str(procs.tmp)}
    with Launcher(procs.root / "peers", grace_s=10.0, stop_signal=signal.SIGINT, env=env) as launcher:
        a = launcher.start("a", "--wait-for-peers", "2", "--shard", "0/2", config=cfg)
        b = launcher.start("b", "--wait-for-peers", "2", "--shard", "1/2", config=cfg, initial_peers=a.address())
        wait_until(lambda: a.round() >= 3 and b.round() >= 3, 120, "two peers train", [a, b])
        for p in (a, b):
            (daemon,) = [d for d in procs.p2pd() if _ppid(d) == p.proc.pid]
            assert os.getpgid(daemon) == daemon != os.getpgid(p.proc.pid), (daemon, p.proc.pid)
        b.send_signal(signal.SIGINT, group=True)  # what the terminal does: the peer's whole group
        assert b.wait(10) == 0, b.tail()  # before SIGKILL, its summary written
        assert b.events("finished"), b.tail()
        assert "Connection lost" not in b.err.read_text(errors="replace"), b.tail()
        # its partner read the goodbye: it goes on alone, not waiting on b to a deadline every round
        r = a.round()
        wait_until(lambda: any(e["members"] == 1 for e in a.events("round")), 60, "a sees b leave", [a])
        assert a.round() >= r
        a.send_signal(signal.SIGINT, group=True)
        assert a.wait(10) == 0, a.tail()
    poll(lambda: not procs.alive(), 30, lambda: f"every marked process gone; alive: {procs.describe()}")

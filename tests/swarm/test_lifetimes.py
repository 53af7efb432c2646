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
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.peer.lifeline import marked

pytestmark = pytest.mark.timeout(240)

MARK = "LOCOMM_LIFETIME_TEST"


def small_spec(path: Path) -> Path:
    spec = RunSpec.preset("nano").replace("data", batch_size=8, seq_len=64, max_corpus_mb=1.0)
    spec.replace("outer", algo="noloco").save(path)
    return path


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


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
        self.tmp = tmp / "tmp"
        self.tmp.mkdir()
        self.root = tmp

    def popen(self, args: list[str], name: str) -> subprocess.Popen:
        env = {**os.environ, MARK: self.token, "TMPDIR": str(self.tmp)}
        err = open(self.root / f"{name}.err", "w")  # noqa: SIM115 - the child holds it
        cmd = [sys.executable, "-m", "locomm.cli.main", *args]
        kw = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=self.root)
        return subprocess.Popen(cmd, start_new_session=True, **kw)

    def alive(self) -> list[int]:
        return marked(self.token, name=MARK)

    def p2pd(self) -> list[int]:
        return [p for p in self.alive() if comm(p) == "p2pd"]

    def folders(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("locomm-"))

    def describe(self) -> str:
        return ", ".join(f"{p}:{comm(p)}" for p in self.alive()) or "none"

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


def test_sigkill_of_the_launcher_mid_start_up_takes_every_peer_and_the_folder(procs: Marked) -> None:
    """Data-parallel: the launcher SIGKILLed while its peers start; peers, p2pd, reaper and folder go."""
    spec = small_spec(procs.root / "run.toml")
    launcher = procs.popen(["swarm", "--peers", "2", "--rounds", "50", "--config", str(spec)], "launcher")
    try:
        poll(lambda: procs.p2pd() or launcher.poll() is not None, 90, "the first peer's p2pd is up")
        assert launcher.poll() is None, (procs.root / "launcher.err").read_text()
        assert procs.folders(), "the swarm folder exists while the launcher runs"
        launcher.kill()
        launcher.wait()
        procs.assert_gone()
    finally:
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_sighup_of_a_pipeline_launcher_stops_it_cleanly(procs: Marked) -> None:
    """Pipeline 2x2: SIGHUP (the ssh session closing) is a clean stop: exit 0, no traceback, nothing left.

    Sent once the first peer's p2pd is up: the launcher has its handlers, the first peer stops cleanly
    and the next is still starting (a peer SIGINTed inside ``P2P.create`` waits out p2pd's bootstrap, which
    is the Host's start-up, not the launcher's)."""
    spec = small_spec(procs.root / "run.toml")
    args = ["swarm", "--pipeline", "2x2", "--rounds", "50", "--config", str(spec), "--json"]
    launcher = procs.popen(args, "launcher")
    try:
        poll(lambda: procs.p2pd() or launcher.poll() is not None, 90, "the first peer's p2pd is up")
        assert launcher.poll() is None, (procs.root / "launcher.err").read_text()
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGHUP)
        rc = launcher.wait(timeout=60)
        print(f"launcher stopped in {time.monotonic() - t0:.1f} s")
        err = (procs.root / "launcher.err").read_text()
        assert rc == 0, err
        assert "Traceback" not in err, err
        procs.assert_gone(timeout_s=10)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_sigkilled_peer_takes_its_p2pd_with_it(procs: Marked) -> None:
    """`locomm-peer join` SIGKILLed (no launcher around it): its p2pd gets the parent-death signal."""
    spec = small_spec(procs.root / "run.toml")
    addr = procs.root / "peer.addr"
    args = ["join", "--config", str(spec), "--announce-file", str(addr), "-q"]
    args += ["--checkpoint-dir", str(procs.root / "ckpt")]
    peer = procs.popen(args, "peer")
    try:
        poll(lambda: addr.exists() or peer.poll() is not None, 90, "the peer announced its address")
        assert peer.poll() is None, (procs.root / "peer.err").read_text()
        daemons = procs.p2pd()
        assert daemons, f"the peer runs a p2pd: {procs.describe()}"
        os.kill(peer.pid, signal.SIGKILL)  # the peer alone, not its group
        peer.wait()
        poll(lambda: not set(daemons) & set(procs.alive()), 15, f"its p2pd {daemons} is gone")
    finally:
        with contextlib.suppress(OSError):
            os.killpg(peer.pid, signal.SIGKILL)

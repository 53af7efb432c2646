"""What a killed peer leaves: p2pd's unix sockets are removed by the next start (its own records only), and a
full disk drops event-log lines instead of killing the peer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from locomm.peer.metrics import EventLog
from locomm.peer.transport import leftovers

pytestmark = pytest.mark.timeout(120)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_only_recorded_sockets_of_dead_processes(tmp_path):
    recs, socks = tmp_path / "records", tmp_path / "socks"
    socks.mkdir()
    dead = [socks / "hivemind-p2pd-AbC_12-x.sock", socks / "hivemind-p2pclient-AbC_12-x.sock"]
    alive = [socks / "hivemind-p2pd-live.sock"]
    foreign = socks / "not-hivemind.sock"
    for f in [*dead, *alive, foreign]:
        f.write_bytes(b"")
    recs.mkdir()
    (recs / "1-a.json").write_text(json.dumps({"pid": _dead_pid(), "sockets": [str(p) for p in dead + [foreign]]}))
    (recs / "2-b.json").write_text(json.dumps({"pid": os.getpid(), "sockets": [str(p) for p in alive]}))
    (recs / "3-c.json").write_text("{torn")
    assert leftovers.sweep(recs) == 2
    assert not any(p.exists() for p in dead)
    assert foreign.exists() and alive[0].exists()  # not hivemind's name / a live process's
    assert sorted(p.name for p in recs.iterdir()) == ["2-b.json"]


def test_sockets_are_recorded_as_p2pd_is_spawned_before_it_runs(tmp_path, monkeypatch):
    """lifeline's hook on hivemind's ``_make_process_args`` records both sockets from p2pd's ``listen`` argument
    before p2pd starts (a kill inside ``P2P.create`` leaves a record); the record of the running daemon is the
    same file."""
    from hivemind.utils.multiaddr import Multiaddr

    from locomm.peer import lifeline

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    daemon, client = "/tmp/hivemind-p2pd-Ab_c-9.sock", "/tmp/hivemind-p2pclient-Ab_c-9.sock"
    make = lifeline._shimmed(lambda **kw: ["/opt/bin/p2pd", f"-listen={kw['listen']}"])
    argv = make(listen=Multiaddr(f"/unix{daemon}"))
    assert argv[-2:] == ["/opt/bin/p2pd", f"-listen=/unix{daemon}"]  # behind the shim, unchanged
    (rec,) = leftovers.records_dir().glob("*.json")
    assert json.loads(rec.read_text()) == {"pid": os.getpid(), "sockets": [daemon, client]}
    assert rec.stat().st_mode & 0o777 == 0o600  # as every file locomm writes

    class Running:  # what record() reads of hivemind's P2P
        _daemon_listen_maddr = {"unix": daemon}
        _client_listen_maddr = {"unix": client}

    assert leftovers.record(Running()) == rec
    assert leftovers.record_spawn("/ip4/1.2.3.4/tcp/1") is None and leftovers.record_spawn(None) is None
    lifeline._shimmed(lambda **kw: ["/bin/true"])(listen=Multiaddr("/unix/tmp/hivemind-p2pd-other.sock"))
    assert len(list(leftovers.records_dir().glob("*.json"))) == 1  # only p2pd's arguments are read
    leftovers.forget(None, Running())  # a try cut before P2P.create returned holds no record path: found by name
    assert not list(leftovers.records_dir().glob("*.json"))


def test_a_killed_peers_p2pd_sockets_go_at_the_next_start(tmp_path):
    """A real p2pd: the process that started it records its sockets and is killed with it (SIGKILL to the
    group: nothing runs hivemind's cleanup); the sockets stay until the next sweep removes them."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from hivemind.p2p import P2P
        from locomm.peer.transport import leftovers

        async def main():
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            leftovers.record(p2p, Path({str(tmp_path)!r}))
            print("\\n".join(leftovers.sockets_of(p2p)), flush=True)
            print("up", flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        while (line := proc.stdout.readline().strip()) != "up":
            assert line or proc.poll() is None, "the peer process ended before its p2pd was up"
            if line:
                lines.append(line)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    socks = [Path(p) for p in lines]
    assert len(socks) == 2 and all(leftovers.SOCKET_NAME.fullmatch(p.name) for p in socks)
    deadline = time.monotonic() + 10
    while not all(p.exists() for p in socks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(p.exists() for p in socks), "nothing was left to sweep"
    assert leftovers.sweep(tmp_path) >= 1
    assert not any(p.exists() for p in socks) and not list(tmp_path.glob("*.json"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_drops_event_lines_and_the_peer_goes_on():
    log = EventLog(Path("/dev/full"))  # every write: ENOSPC
    log.write("round", round=1)
    log.write("round", round=2)
    assert log.dropped == 2
    log.close()

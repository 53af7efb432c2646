"""A volunteer's first command: `join` listens where others can reach it, and a missing address is an error,
not a swarm of one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from locomm.cli.options import DEFAULT_PORT, listen_addrs
from locomm.config import ConfigError
from locomm.peer.options import local_defaults


def join(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "join", *args], capture_output=True, text=True, timeout=120
    )


def test_join_without_peers_or_new_swarm_says_what_to_do_and_exits_2():
    r = join()
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines() == [
        "error: no swarm to join: pass --initial-peers MULTIADDR (a peer's address, as it prints it), "
        "or --new-swarm to start one"
    ]
    both = join("--new-swarm", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/QmX")
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_join_and_doctor_listen_on_every_interface_on_one_port_by_default():
    assert listen_addrs((), DEFAULT_PORT, None, ()) == ((f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}",), ())
    assert listen_addrs((), 4001, "203.0.113.7", ()) == (("/ip4/0.0.0.0/tcp/4001",), ("/ip4/203.0.113.7/tcp/4001",))
    assert listen_addrs(("/ip4/127.0.0.1/tcp/0",), DEFAULT_PORT, None, ()) == (("/ip4/127.0.0.1/tcp/0",), ())
    with pytest.raises(ConfigError, match="fixed --port"):
        listen_addrs((), 0, "203.0.113.7", ())
    with pytest.raises(ConfigError, match="not an IP"):
        listen_addrs((), 1, "example.org", ())


def test_tests_and_local_swarms_keep_loopback_explicitly():
    assert local_defaults(["--until-round", "3"]) == ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--new-swarm"]
    assert local_defaults(["--initial-peers", "M", "--host-maddrs", "/ip4/10.0.0.2/tcp/0"]) == []


def test_max_memory_takes_sizes_as_accelerate_and_petals_write_them():
    from locomm.cli.options import MemorySize

    m = MemorySize()
    assert [m.convert(v, None, None) for v in ("8", "8GiB", "8 gib", "512MiB", "2T")] == [8.0, 8.0, 8.0, 0.5, 2048.0]
    assert abs(m.convert("8GB", None, None) - 8e9 / 2**30) < 1e-12
    with pytest.raises(Exception, match="a size such as 8GiB"):
        m.convert("8XB", None, None)
    r = join("--plan", "--preset", "small", "--device", "cuda", "--max-memory", "8GiB", "--json")
    assert r.returncode == 0, r.stderr


def test_log_lines_as_json():
    import json
    import logging

    from locomm.cli.daemon import JsonLines

    rec = logging.LogRecord("locomm.peer.host", logging.INFO, __file__, 1, "peer %s up", ("QmX",), None)
    line = json.loads(JsonLines().format(rec))
    assert line["level"] == "INFO" and line["logger"] == "locomm.peer.host" and line["msg"] == "peer QmX up"

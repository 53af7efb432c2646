"""Shared fixtures of the swarm tests: real `locomm-peer join` processes, owned by the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from locomm.testing.launcher import Launcher


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """A launcher into ``tmp_path``; at teardown every peer it started is stopped (SIGTERM, 5 s, SIGKILL
    to each peer's whole process group, so no p2pd outlives the test), whatever the test did."""
    with Launcher(tmp_path, grace_s=5.0) as peers:
        yield peers

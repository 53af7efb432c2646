"""The compute thread runs below the rest of the peer (host.COMPUTE_NICE), so the CPU work that feeds the link
(p2pd, encodes, decodes) goes first; the loop's own thread keeps its priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from locomm.config import RunSpec
from locomm.peer.host import COMPUTE_NICE, Host
from locomm.peer.options import NodeOptions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def nice_here() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_compute_thread_runs_nicer_than_the_thread_that_made_the_host():
    before = nice_here()
    host = Host(RunSpec.preset("nano"), NodeOptions())
    try:
        compute = host.pool.submit(nice_here).result(timeout=10)
        codec = host.codec_pool.submit(nice_here).result(timeout=10)
    finally:
        host.pool.shutdown()
        host.codec_pool.shutdown()
    assert compute == min(19, before + COMPUTE_NICE)
    assert codec == before  # the codec work feeds the link: it keeps the peer's priority
    assert nice_here() == before  # only the compute thread was lowered

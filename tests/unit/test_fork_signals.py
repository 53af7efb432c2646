"""A fork child of a peer does not share its parent's signal handling (``lifeline._child_signals``).

The peer's event loop handles SIGINT and SIGTERM by writing into its wakeup socket; a fork inherited both, so
hivemind's ``terminate()`` of DiLoCo's DHT process did nothing (the peer's exit then hung on multiprocessing's
join of it) and each signal the child got reached the parent's loop a second time. Run in a process of its own:
``lifeline.install`` changes hivemind and the fork hooks for the whole process, as it does in a peer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the after-fork hook is installed on Linux only")

SCRIPT = """
import asyncio, json, multiprocessing as mp, signal
from locomm.peer import lifeline

def report(q):
    q.put([signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
           signal.set_wakeup_fd(-1)])

async def main():
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: None)  # as the host does
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=report, args=(q,))
    p.start()
    got = q.get(timeout=30)
    p.join(30)
    return got

assert lifeline.install()
print(json.dumps(asyncio.run(main())))
"""


def test_a_fork_child_takes_sigterm_ignores_sigint_and_writes_into_no_parent_socket():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, -1]

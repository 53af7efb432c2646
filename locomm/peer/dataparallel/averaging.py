"""DiLoCo's all-reduce over hivemind's DecentralizedAverager: the baseline users run today.

This is the one place locomm uses ``hivemind.DHT`` (which forks a process with a
p2pd of its own) instead of the node's in-loop ``DHTNode``: DecentralizedAverager
needs it. The averager's DHT is a second identity in the process; its address
travels in the node's heartbeat (``avg_maddrs``) so joiners can bootstrap it.
Its p2pd listens on the node's host addresses (their IPs; the port is
``NodeOptions.averager_port``, 0: any), announces the node's announce addresses
with that port when it is fixed, and takes the node's relay settings
(:func:`averager_p2p_kwargs`), so the baseline runs across machines and NATs.
NoLoCo, GASLoC and SparseLoCo never touch this module.

Each round the worker's pseudo-gradients (phi - theta) go into the averager's
tensors, one ``step()`` all-reduces them over whoever matched into the group, and
the protocol core's DiLoCo rule is applied to the mean. A failed or timed-out
step is data: the round goes on with this worker's own pseudo-gradient.

The mean comes back as one payload under ``GROUP_MEAN``, with no sender: the
averager cannot attribute contributions. The poisoning defence
(``protocol/defence.py``, run by ``Rounds.settle`` for both transports) screens
it: a non-finite mean, or one whose norm exceeds ``defence.diloco_factor`` x the
own pseudo-gradient's, falls back to the own step (``Rounds.fallback``). That
bounds how far one round can throw a peer; it does not stop an attacker whose
contribution keeps the mean under the bound, and it names nobody to ban.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from locomm.protocol.defence import GROUP_MEAN

log = logging.getLogger(__name__)
SHUTDOWN_JOIN_S = 5.0
"""How long the averager's and its DHT's processes get to end after hivemind's shutdown, before a kill."""


class AveragerExchange:
    """Owns a hivemind.DHT and a DecentralizedAverager for one node's DiLoCo rounds."""

    def __init__(
        self,
        names: list[str],
        shapes: Mapping[str, torch.Size],
        *,
        run_id: str,
        initial_peers: list[str],
        timeout: float,
        allreduce_timeout: float | None = None,
        group_size: int | None,
        p2p_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``timeout``: for matchmaking and each request; ``allreduce_timeout`` (default ``timeout``): for
                the all-reduce itself, which the node sizes by the payload's bytes. ``p2p_kwargs``: the DHT's p2pd
        (``hivemind.P2P.create`` arguments; default: loopback only)."""
        import hivemind  # noqa: PLC0415

        from locomm.peer.transport import dht_clock  # noqa: PLC0415

        dht_clock.install()  # hivemind's averaging modules, imported just now, on our DHT time too
        self.names = names
        allreduce_timeout = timeout if allreduce_timeout is None else allreduce_timeout
        self.timeout = timeout + allreduce_timeout  # a step: find a group, then all-reduce
        kw = dict(p2p_kwargs or {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]})
        self.dht = hivemind.DHT(start=True, initial_peers=initial_peers or None, **kw)
        tensors = [torch.zeros(shapes[n], dtype=torch.float32) for n in names]
        self.averager = hivemind.averaging.DecentralizedAverager(
            tensors,
            dht=self.dht,
            prefix=f"locomm_{run_id}_diloco",
            start=True,
            target_group_size=group_size,
            min_group_size=2,
            min_matchmaking_time=2.0,
            request_timeout=min(3.0, timeout),
            allreduce_timeout=allreduce_timeout,
        )

    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def _step(self, payload: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int] | None:
        with self.averager.get_tensors() as tensors:
            for t, n in zip(tensors, self.names):
                t.copy_(payload[n])
        try:
            result = self.averager.step(timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - a failed all-reduce is data, not a crash
            log.warning("DecentralizedAverager step failed: %s", e)
            return None
        if not result:
            return None
        with self.averager.get_tensors() as tensors:
            return {n: t.clone() for n, t in zip(self.names, tensors)}, len(result)

    async def exchange(self, payload: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int] | None:
        """The group's mean payload and the group's size; None when no group formed in time."""
        return await asyncio.to_thread(self._step, payload)

    async def round(self, me: str, payload: Mapping[str, torch.Tensor]) -> tuple[dict, int, int]:
        """One DiLoCo round: (what the outer rule takes, partners that averaged with us, bytes moved)."""
        out = await self.exchange(payload)
        if out is None:
            return {me: payload}, 0, 0
        mean, group = out
        # hivemind keeps no byte counters: a butterfly all-reduce over N peers sends (and receives)
        # (N-1)/N of the payload twice (scatter-reduce, then all-gather of the averaged parts).
        nbytes = sum(v.numel() * v.element_size() for v in payload.values())
        return {GROUP_MEAN: mean}, group - 1, int(2 * nbytes * (group - 1) / max(1, group))

    def shutdown(self) -> None:
        """hivemind's shutdowns, then a bounded end for each helper process: a child still alive after
        ``terminate()`` is killed, since multiprocessing joins every child at exit, without a bound."""
        self.averager.shutdown()
        self.dht.shutdown()
        for proc in (self.averager, self.dht):
            proc.join(SHUTDOWN_JOIN_S)
            if proc.is_alive():
                log.warning("%s did not stop; killing it", type(proc).__name__)
                proc.kill()
                proc.join(SHUTDOWN_JOIN_S)


def _with_port(maddr: str, port: int) -> str:
    """``maddr`` with its tcp/udp port set to ``port``."""
    parts = maddr.split("/")
    for i, p in enumerate(parts[:-1]):
        if p in ("tcp", "udp"):
            parts[i + 1] = str(port)
    return "/".join(parts)


def averager_p2p_kwargs(opts: Any, bootstrap: list[str]) -> dict[str, Any]:
    """The averager DHT's p2pd arguments from the node's options (a :class:`locomm.peer.options.NodeOptions`):
    its host addresses' IPs on ``averager_port``, its announce addresses' when that port is fixed (p2pd cannot
    announce port 0: it then announces what it bound), and the node's relay settings (relays: ``bootstrap``,
    the other averagers, unless the node names its own)."""
    port = opts.averager_port
    announce = [_with_port(m, port) for m in opts.announce_maddrs] if port else []
    return {
        "host_maddrs": [_with_port(m, port) for m in opts.host_maddrs],
        "announce_maddrs": announce or None,
        **opts.nat_kwargs(bootstrap),
    }


async def start_averager(host: Any, codec: Any, *, group_size: int | None) -> AveragerExchange:
    """The DiLoCo averager of a node on ``host`` (a :class:`locomm.peer.host.Host`), bootstrapped from the
    averager addresses in the swarm's heartbeats; the host shuts it down on exit."""
    bootstrap: list[str] = []
    joiner = bool(host.opts.initial_peers)
    for _ in range(120 if joiner else 1):  # a joiner needs someone's averager address
        bootstrap = [m for b in await host.read_beats() if b.peer != host.me for m in b.avg_maddrs]
        if bootstrap or not joiner:
            break
        await asyncio.sleep(0.5)
    names = [t.name for t in codec.tensors]
    shapes = {t.name: torch.Size(t.shape) for t in codec.tensors}
    # Built on the loop's thread: DecentralizedAverager installs signal handlers, which only the
    # main thread may do. It blocks the loop for a moment at start-up, before any training.
    # The all-reduce's deadline is sized by its bytes like every transfer's (protocol/timing.py).
    payload_bytes = 4 * sum(math.prod(t.shape) for t in codec.tensors)
    averager = AveragerExchange(
        names,
        shapes,
        run_id=host.run_id,
        initial_peers=bootstrap,
        timeout=host.spec.network.request_timeout_s,
        allreduce_timeout=host.limits.allreduce_deadline_s(payload_bytes),
        group_size=group_size,
        p2p_kwargs=averager_p2p_kwargs(host.opts, bootstrap),
    )
    host.on_close.append(averager.shutdown)
    return averager

"""Sans-IO outer algorithms: tensors and peer ids in, tensors and decisions out.

No sockets, asyncio, threads or clocks here; the simulator (sim/) and the peer
daemon (peer/) drive the same code.
"""

from __future__ import annotations

from locomm.config import OuterConfig
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload
from locomm.protocol.ddp import DDP
from locomm.protocol.diloco import DiLoCo
from locomm.protocol.gasloc import GASLoC
from locomm.protocol.noloco import NoLoCo
from locomm.protocol.sparseloco import SparseLoCo

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {cls.name: cls for cls in (DiLoCo, NoLoCo, GASLoC, SparseLoCo)}

__all__ = [
    "ALGORITHMS",
    "DDP",
    "DiLoCo",
    "Exchange",
    "GASLoC",
    "NoLoCo",
    "OuterAlgorithm",
    "Params",
    "Payload",
    "SparseLoCo",
    "build_outer",
]


def build_outer(cfg: OuterConfig, params: Params, me: int) -> OuterAlgorithm:
    """The outer algorithm a config names, for worker ``me`` starting from ``params``."""
    if cfg.algo not in ALGORITHMS:
        raise ValueError(
            f"outer.algo={cfg.algo!r} is not a round-based outer algorithm (choose from {', '.join(ALGORITHMS)})"
        )
    return ALGORITHMS[cfg.algo](cfg, params, me)

"""The interface every outer algorithm implements, and the state they share.

Sans-IO: an algorithm never touches a socket, a clock or a thread. A transport
(the simulator, or the peer daemon) drives it once per round:

    ex = algo.plan(round_idx, members, params)      # whom to exchange with, what to send
    received = transport.exchange(ex)                # {worker: payload}, self included,
                                                     # only those who answered
    algo.apply(round_idx, params, received)          # the outer update, in place

``params`` maps parameter names to the worker's live model tensors (the fast
weights theta); ``apply`` writes the new theta into them. Outer state (phi,
momentum, error feedback) is fp32 and lives in the algorithm object.

A partner that does not answer is simply absent from ``received``; every rule
here is defined for whoever answered (down to the worker alone).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from locomm.config import OuterConfig

Payload = dict[str, "torch.Tensor | bytes"]
Params = Mapping[str, torch.Tensor]


@dataclass
class Exchange:
    """What one worker does this round."""

    peers: list[int]
    """Workers to exchange with (self excluded); for a collective, every other member."""
    payload: Payload
    """What this worker sends: tensors, or bytes already encoded by the algorithm's codec."""
    collective: bool = False
    """True: an all-reduce/all-gather over every member (ring cost, a barrier on the slowest)."""
    roles: dict[str, str] = field(default_factory=dict)
    """Tensor role of each payload prefix ('phi' -> 'parameter', ...) for codec choice."""


class OuterAlgorithm(ABC):
    """One worker's view of an outer algorithm."""

    name: ClassVar[str]
    payload_roles: dict[str, str]
    """Payload keys are f"{prefix}/{parameter name}"; this maps each prefix to its tensor role
    ("parameter", "outer_gradient"), which picks the codec stack from the run spec's compression."""
    payload_encoded: dict[str, str] = {}
    """Prefixes whose values the algorithm encodes itself (stateful codecs): prefix -> codec stack."""

    def __init__(self, cfg: OuterConfig, params: Params, me: int) -> None:
        self.cfg = cfg
        self.me = me
        # phi: the outer weights, fp32, a copy of the starting point.
        self.phi: dict[str, torch.Tensor] = {k: v.detach().float().clone() for k, v in params.items()}

    @abstractmethod
    def plan(self, round_idx: int, members: Sequence[int], params: Params) -> Exchange:
        """Called at the end of a round's H inner steps."""

    @abstractmethod
    def apply(self, round_idx: int, params: Params, received: Mapping[int, Payload]) -> None:
        """Apply the outer update in place; ``received`` holds self and whoever answered."""

    def _set_params(self, params: Params, source: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(source[k])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Outer state as flat named tensors "{buffer}/{parameter}" (for checkpoints and state sync)."""
        return {f"phi/{k}": v for k, v in self.phi.items()}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load what ``state_dict`` produced (a checkpoint, or a donor's state)."""
        own = self.state_dict()
        missing = set(own) - set(tensors)
        if missing:
            raise KeyError(f"outer state lacks {sorted(missing)[:3]}")
        for key, target in own.items():
            src = tensors[key]
            if src.shape != target.shape:
                raise ValueError(f"outer state {key}: shape {tuple(src.shape)} != {tuple(target.shape)}")
            target.copy_(src)


def mean_of(payloads: Sequence[Payload], key: str) -> torch.Tensor:
    """Mean of one tensor over several payloads, in fp32."""
    acc = payloads[0][key].float().clone()
    for p in payloads[1:]:
        acc.add_(p[key].float())
    return acc.div_(len(payloads))

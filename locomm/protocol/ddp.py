"""Plain data parallelism: every inner step, all-reduce the gradients (the upper-bound baseline).

    g = (1/N) sum_i g_i      # over the workers that answered
    every worker steps its inner optimizer on g, so replicas stay identical

This is not a round-based outer algorithm: the transport calls it between
``backward()`` and ``optimizer.step()`` on every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from locomm.protocol.base import Exchange, Payload, mean_of


class DDP:
    name = "ddp"

    def __init__(self, me: int) -> None:
        self.me = me

    def plan(self, members: Sequence[int], grads: Mapping[str, torch.Tensor]) -> Exchange:
        return Exchange(
            peers=[m for m in members if m != self.me],
            payload={f"grad/{k}": g.float() for k, g in grads.items()},
            collective=True,
            roles={"grad": "outer_gradient"},
        )

    def apply(self, grads: Mapping[str, torch.Tensor], received: Mapping[int, Payload]) -> None:
        got = list(received.values())
        with torch.no_grad():
            for k, g in grads.items():
                g.copy_(mean_of(got, f"grad/{k}"))

"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105): the synchronous all-reduce baseline.

    Delta   = (1/N) sum_i (phi - theta_i)       # all-reduce mean over who answered
    m       = mu*m + Delta
    phi     = phi - eta*(Delta + mu*m)          # torch.optim.SGD(nesterov=True) on grad Delta
    theta_i = phi

``outer.nesterov = false`` takes the heavy-ball step ``phi = phi - eta*m`` instead, as the DiLoCo baseline
of NoLoCo's public configs does (momentum 0.3, H = 100).

The peer daemon runs this round over hivemind's DecentralizedAverager; here it
is the pure rule, which the simulator and the tests drive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from locomm.config import OuterConfig
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload, mean_of


class DiLoCo(OuterAlgorithm):
    name = "diloco"
    payload_roles = {"delta": "outer_gradient"}

    def __init__(self, cfg: OuterConfig, params: Params, me: int) -> None:
        super().__init__(cfg, params, me)
        self.m = {k: torch.zeros_like(v) for k, v in self.phi.items()}

    def plan(self, round_idx: int, members: Sequence[int], params: Params) -> Exchange:
        delta = {f"delta/{k}": self.phi[k] - p.detach().float() for k, p in params.items()}
        return Exchange(
            peers=[m for m in members if m != self.me],
            payload=delta,
            collective=True,
            roles={"delta": "outer_gradient"},
        )

    def apply(self, round_idx: int, params: Params, received: Mapping[int, Payload]) -> None:
        got = list(received.values())
        eta, mu = self.cfg.lr, self.cfg.momentum
        for k in self.phi:
            d = mean_of(got, f"delta/{k}")
            self.m[k].mul_(mu).add_(d)
            step = d.add_(self.m[k], alpha=mu) if self.cfg.nesterov else self.m[k]
            self.phi[k].sub_(step, alpha=eta)
        self._set_params(params, self.phi)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"m/{k}": v for k, v in self.m.items()}}

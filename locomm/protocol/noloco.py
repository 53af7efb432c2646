"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): small random groups, no all-reduce.

As the public code (jkolehm/noloco, sparse_optimizer_c.py) implements it:

    G     = this worker's seeded group of about n (schedule.noloco_groups)
    Dbar  = (1/|A|) sum_{j in A} (theta_j - phi_j)    # A: the group members who answered
    Pbar  = (1/|A|) sum_{j in A} phi_j
    m_i   = beta*m_i + alpha*Dbar + gamma*(Pbar - phi_i)
    phi_i = phi_i + m_i ;  theta_i = phi_i

gamma defaults to alpha as in the public code. Alone (nobody answered), the round
is a local heavy-ball step on the worker's own progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from locomm.config import OuterConfig
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload, mean_of
from locomm.protocol.schedule import group_of, noloco_groups


class NoLoCo(OuterAlgorithm):
    name = "noloco"
    payload_prefixes = ("phi", "delta")

    def __init__(self, cfg: OuterConfig, params: Params, me: int) -> None:
        super().__init__(cfg, params, me)
        self.m = {k: torch.zeros_like(v) for k, v in self.phi.items()}

    def plan(self, round_idx: int, members: Sequence[int], params: Params) -> Exchange:
        group = group_of(self.me, noloco_groups(round_idx, members, self.cfg.group_size, self.cfg.seed))
        payload: Payload = {}
        for k, p in params.items():
            payload[f"phi/{k}"] = self.phi[k].clone()  # a snapshot: apply() updates phi in place
            payload[f"delta/{k}"] = p.detach().float() - self.phi[k]
        return Exchange(peers=[g for g in group if g != self.me], payload=payload,
                        roles={"phi": "parameter", "delta": "outer_gradient"})

    def apply(self, round_idx: int, params: Params, received: Mapping[int, Payload]) -> None:
        got = list(received.values())
        alpha, beta, gamma = self.cfg.lr, self.cfg.noloco_beta, self.cfg.gamma
        for k in self.phi:
            dbar = mean_of(got, f"delta/{k}")
            pbar = mean_of(got, f"phi/{k}")
            m = self.m[k].mul_(beta).add_(dbar, alpha=alpha).add_(pbar.sub_(self.phi[k]), alpha=gamma)
            self.phi[k].add_(m)
        self._set_params(params, self.phi)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"m/{k}": v for k, v in self.m.items()}}

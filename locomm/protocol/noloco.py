"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): small random groups, no all-reduce.

As the public code (jkolehm/noloco, sparse_optimizer_c.py) implements it:

    G     = this worker's seeded group of about n (schedule.noloco_groups)
    Dbar  = (1/|A|) sum_{j in A} (theta_j - phi_j)    # A: the group members who answered
    Pbar  = (1/|A|) sum_{j in A} phi_j
    m_i   = beta*m_i + alpha*Dbar + gamma*(Pbar - phi_i)
    phi_i = phi_i + m_i ;  theta_i = phi_i

gamma defaults to alpha as in the public code. Alone (nobody answered), the round
is a local heavy-ball step on the worker's own progress.

Payload. With gamma == alpha the two terms fold into one:

    alpha*Dbar + gamma*(Pbar - phi_i) = alpha*((1/|A|) sum_{j in A} theta_j - phi_i)

so each worker sends its theta alone (4 bytes per parameter in fp32, half of
phi and theta - phi). With another gamma it sends phi and theta - phi. theta is a
whole weight, so a bf16 cast rounds weights, not deltas: its precision is the
run spec's ``compression.parameter`` (lossless fp32 by default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from locomm.config import OuterConfig
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload, mean_of
from locomm.protocol.schedule import group_of, noloco_groups


class NoLoCo(OuterAlgorithm):
    name = "noloco"

    def __init__(self, cfg: OuterConfig, params: Params, me: int) -> None:
        super().__init__(cfg, params, me)
        self.m = {k: torch.zeros_like(v) for k, v in self.phi.items()}
        self.theta_only = cfg.gamma == cfg.lr
        self.payload_roles = (
            {"theta": "parameter"} if self.theta_only else {"phi": "parameter", "delta": "outer_gradient"}
        )

    def plan(self, round_idx: int, members: Sequence[int], params: Params) -> Exchange:
        group = group_of(self.me, noloco_groups(round_idx, members, self.cfg.group_size, self.cfg.seed))
        payload: Payload = {}
        for k, p in params.items():
            if self.theta_only:
                payload[f"theta/{k}"] = p.detach().float().clone()
            else:
                payload[f"phi/{k}"] = self.phi[k].clone()  # a snapshot: apply() updates phi in place
                payload[f"delta/{k}"] = p.detach().float() - self.phi[k]
        return Exchange(peers=[g for g in group if g != self.me], payload=payload, roles=dict(self.payload_roles))

    def apply(self, round_idx: int, params: Params, received: Mapping[int, Payload]) -> None:
        got = list(received.values())
        alpha, beta, gamma = self.cfg.lr, self.cfg.noloco_beta, self.cfg.gamma
        for k in self.phi:
            if self.theta_only:  # alpha*Dbar + gamma*(Pbar - phi) with gamma == alpha
                step = mean_of(got, f"theta/{k}").sub_(self.phi[k]).mul_(alpha)
            else:
                dbar = mean_of(got, f"delta/{k}")
                pbar = mean_of(got, f"phi/{k}")
                step = dbar.mul_(alpha).add_(pbar.sub_(self.phi[k]), alpha=gamma)
            m = self.m[k].mul_(beta).add_(step)
            self.phi[k].add_(m)
        self._set_params(params, self.phi)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"m/{k}": v for k, v in self.m.items()}}

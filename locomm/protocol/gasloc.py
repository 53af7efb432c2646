"""GASLoC (Cagnasso, Belilovsky, Oyallon 2026, arXiv 2606.11081): gossip + accelerated outer step.

Reconstructed from secondary summaries (docs/algorithms.md §3), not checked against the paper:

    g_i     = theta_i - phi_i                            # drift over this round's inner steps
    y_i     = phi_i + eta*g_i                            # outer-proposed point
    z_i     = y_i + 2a * sum_{j in A_i} w_ij (y_j - y_i) # gossip over the answered neighbours A_i
    theta_i = z_i + gamma*(z_i - z_i_prev)               # momentum on the mixed points (default)
            | z_i + gamma*(y_i - y_i_prev)               # or on the unmixed points
    phi_i   = theta_i                                    # the next round starts here

w_ij are Metropolis weights 1/(1 + max(deg_i, deg_j)) of the round's graph, so the
mixing matrix is symmetric and doubly stochastic for every topology. On a matching
(w = 1/2) this is the summary's z_i = y_i - a(y_i - y_j); a = 1/2 averages the pair
exactly, and on the complete graph a = 1/2 gives the global mean, where momentum on
the mixed points reproduces DiLoCo's Nesterov step with gamma = mu (tested).
z_prev and y_prev start as the initial weights. A worker not drawn to take part
(probability 1 - p) keeps training: its theta and outer state are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from locomm.config import OuterConfig
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload
from locomm.protocol.schedule import gasloc_graph, metropolis_weight


class GASLoC(OuterAlgorithm):
    name = "gasloc"
    payload_roles = {"y": "parameter"}

    def __init__(self, cfg: OuterConfig, params: Params, me: int) -> None:
        super().__init__(cfg, params, me)
        self.prev = {k: v.clone() for k, v in self.phi.items()}  # z_prev (or y_prev)
        self._degrees: dict[int, int] = {}
        self._y: dict[str, torch.Tensor] = {}
        self._active = False

    def plan(self, round_idx: int, members: Sequence[int], params: Params) -> Exchange:
        graph = gasloc_graph(
            round_idx, members, self.cfg.topology, k=self.cfg.k_peers, p=self.cfg.participation, seed=self.cfg.seed
        )
        self._active = self.me in graph
        self._degrees = {m: len(n) for m, n in graph.items()}
        eta = self.cfg.lr
        self._y = {k: self.phi[k] + eta * (p.detach().float() - self.phi[k]) for k, p in params.items()}
        peers = sorted(graph.get(self.me, ()))
        return Exchange(peers=peers, payload={f"y/{k}": v for k, v in self._y.items()}, roles={"y": "parameter"})

    def apply(self, round_idx: int, params: Params, received: Mapping[int, Payload]) -> None:
        if not self._active:
            return  # not drawn this round: keep training from where we are
        a, gamma = self.cfg.gasloc_mix, self.cfg.gasloc_gamma
        d_me = self._degrees.get(self.me, 0)
        others = [(j, pl) for j, pl in received.items() if j != self.me]
        mixed_momentum = self.cfg.gasloc_momentum_on == "mixed"
        for k, y in self._y.items():
            z = y.clone()
            for j, pl in others:
                w = metropolis_weight(d_me, self._degrees.get(j, 1))
                z.add_(pl[f"y/{k}"].float() - y, alpha=2 * a * w)
            ref = z if mixed_momentum else y
            theta = z + gamma * (ref - self.prev[k])
            self.prev[k] = ref
            self.phi[k] = theta
        self._set_params(params, self.phi)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"prev/{k}": v for k, v in self.prev.items()}}

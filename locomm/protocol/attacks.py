"""Poisoned outer updates, for benchmarks and tests of the defence (protocol/defence.py): never run by default.

:func:`corrupt` turns a worker's weights theta into an attacker's before the round is planned, so every
algorithm's payload carries the attack (NoLoCo's theta, GASLoC's y, SparseLoCo's encoded pseudo-gradient,
DiLoCo's delta). With ``p = theta - phi`` (this round's local progress, ``phi`` the attacker's outer weights):

    scale100   phi + 100*p                     # a partner's progress blown up x100
    signflip   phi - p                         # progress reversed (the norm of an honest update)
    target     2*target - theta, target = 0    # i.e. -theta. NoLoCo's pair average (x_victim + x_sent)/2
                                               # lands on the target when theta ~ theta_victim (n = 2)
    noise      theta + N(0, s^2), per tensor   # s chosen so the noise's norm is 10 x ||p|| of that tensor

The daemon calls it as ``params = corrupt(kind, self.params(), self.algo.phi, gen)`` right before
``rounds.start(...)`` when a peer runs with the benchmark-only ``--attack KIND``; the simulator does the same
for its ``attackers``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

ATTACKS = ("scale100", "signflip", "target", "noise")


def corrupt(
    kind: str,
    params: Mapping[str, torch.Tensor],
    phi: Mapping[str, torch.Tensor],
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """The attacker's weights: new tensors of ``params``' dtypes (``params`` and ``phi`` are not touched).

    Args:
        kind: One of :data:`ATTACKS`.
        params: The worker's weights theta, by parameter name.
        phi: Its outer weights (fp32), by the same names.
        generator: For ``noise``: the random source (CPU), so a run is reproducible.
    """
    if kind not in ATTACKS:
        raise ValueError(f"attack: must be one of {', '.join(ATTACKS)}; got {kind!r}")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k, p in params.items():
            theta = p.detach().float()
            base = phi[k].to(theta.device)
            if kind == "scale100":
                x = base + 100.0 * (theta - base)
            elif kind == "signflip":
                x = base - (theta - base)
            elif kind == "target":
                x = -theta  # 2*target - theta with target = 0
            else:
                n = float((theta - base).norm())
                z = torch.randn(theta.shape, generator=generator, dtype=torch.float32)
                x = theta + z.to(theta.device) * (10.0 * n / math.sqrt(max(1, theta.numel())))
            out[k] = x.to(p.dtype)
    return out

"""AdamS (arXiv 2505.16363): Adam without a second-moment buffer.

The denominator is rebuilt each step from the previous first moment and the
current gradient, ``v = b2 * mh^2 + (1 - b2) * g^2`` with ``mh`` the
bias-corrected previous momentum, so the optimizer keeps one state tensor per
parameter instead of two. Update rule as docs/algorithms.md §5 gives it:

    theta = (1 - lr*wd) * theta
    mh    = m_prev / (1 - b1^t)
    v     = b2 * mh^2 + (1 - b2) * g^2
    m     = b1 * m_prev + (1 - b1) * g
    theta = theta - lr * (m / (1 - b1^t)) / (sqrt(v) + eps)

SCAPE reads ``state["exp_avg"]`` (the first moment) to build its masks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer


class AdamS(Optimizer):
    """AdamS with decoupled weight decay; state per parameter: ``step``, ``exp_avg`` (fp32)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
    ) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamS hyperparameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"].item()
                m = state["exp_avg"]
                bc = 1 - b1**t
                mh = m / bc  # m_prev bias-corrected with the current step's 1 - b1^t
                v = mh.square().mul_(b2).addcmul_(g, g, value=1 - b2)
                m.mul_(b1).add_(g, alpha=1 - b1)
                if wd:
                    p.mul_(1 - lr * wd)
                upd = (m / bc).div_(v.sqrt_().add_(eps))
                p.add_(upd.to(p.dtype), alpha=-lr)
        return loss

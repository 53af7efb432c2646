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

``bias_correction=False`` drops both divisions by 1 - b1^t: the rule as the paper's equations are quoted by
secondary sources (its reference code is not public; docs/results/scape.md). With them the first step is
1/sqrt(1 - b2) = 4.5 lr per coordinate (m_prev = 0, v = (1 - b2) g^2); without, 0.45 lr.

SCAPE reads ``state["exp_avg"]`` (the first moment) to build its masks, and may hold the coordinates it did not
synchronize this step (:meth:`AdamS.hold_off`): off the mask, weight, first moment and weight decay stay as they
are, where a zero gradient would decay m by b1 and v by b2 together and keep stepping ~b1/sqrt(b2) = 0.92 lr along
stale momentum (docs/algorithms.md §5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
        bias_correction: bool = True,
    ) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamS hyperparameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._masks: dict[torch.Tensor, torch.Tensor] = {}
        self.bias_correction = bias_correction

    def hold_off(self, masks: dict[torch.Tensor, torch.Tensor] | None) -> None:
        """For the NEXT :meth:`step` only: per parameter, a bool tensor of its shape; where False the weight and
        its first moment are held (no update, no decay). Parameters absent from ``masks`` step everywhere."""
        self._masks = dict(masks or {})

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
                bc = 1 - b1**t if self.bias_correction else 1.0
                mh = m / bc  # m_prev bias-corrected with the current step's 1 - b1^t
                v = mh.square().mul_(b2).addcmul_(g, g, value=1 - b2)
                keep = self._masks.get(p)
                m_new = m * b1 + g * (1 - b1)
                upd = (m_new / bc).div_(v.sqrt_().add_(eps)).mul_(lr)
                if wd:
                    upd.add_(p.float(), alpha=lr * wd)  # decoupled decay, (1 - lr*wd) * theta, as one update
                if keep is not None:
                    m_new = torch.where(keep, m_new, m)
                    upd.mul_(keep)
                m.copy_(m_new)
                p.sub_(upd.to(p.dtype))
        self._masks = {}
        return loss


def by_param(
    named: Iterable[tuple[str, torch.Tensor]], on: Mapping[str, torch.Tensor] | None
) -> dict[torch.Tensor, torch.Tensor] | None:
    """Masks by parameter name (SCAPE's ``held()``) as :meth:`AdamS.hold_off` takes them: by parameter, each on
    its parameter's device and shape. None (a dense step) stays None."""
    if on is None:
        return None
    return {p: on[k].to(p.device).reshape(p.shape) for k, p in named}

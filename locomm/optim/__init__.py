"""Inner optimizers torch lacks (AdamS) and schedules."""

from __future__ import annotations

import torch

from locomm.config import InnerOptimConfig
from locomm.optim.adams import AdamS
from locomm.optim.schedule import cosine_with_warmup

__all__ = ["AdamS", "build_optimizer", "cosine_with_warmup"]


def build_optimizer(params, cfg: InnerOptimConfig) -> torch.optim.Optimizer:  # noqa: ANN001
    """The inner optimizer a config names; weight decay skips 1-D parameters (norm gains)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    wd = 0.0 if cfg.name == "adam" else cfg.weight_decay
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adams":
        return AdamS(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, bias_correction=cfg.bias_correction)
    # foreach is the fast path on CPU and CUDA alike; fused needs CUDA-only dtypes checks.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=True)

"""One stage replica's compute: micro-batch forward and backward, accumulation, the optimizer step.

Sans-IO (no sockets, no clocks, no threads): the simulator calls it in a loop and the
stage server calls it from its compute thread. A micro-batch is
``forward(mb, tokens, h_in) -> h_out`` then, when the gradient comes back,
``backward(mb, g_out) -> g_in``; the last stage does both at once
(``forward_backward``). Each micro-batch's loss is scaled by 1 / micro-batches per
step, so a step over a whole batch sees the gradient of the batch's mean loss.

Step rule: a replica steps once it has accumulated ``micro_per_step`` backward
passes *and* holds no forward graph still waiting for its gradient (stepping would
change weights those graphs saved); :attr:`step_due` tells the caller to hold new
forwards back until then. Each step clips this stage's gradient norm (the global
norm spans peers that never meet), sets the scheduled LR, steps the inner
optimizer and re-projects W_o, W_2 and E_learn onto span(U).

Memory plans (:mod:`locomm.train.plan`): a stage's micro-batch is the spec's
``pipeline.micro_batch_size`` and it accumulates those itself, so a plan here
sets bf16 autocast (on CUDA) and activation checkpointing per block (every graph
in flight then keeps only its block inputs). Without a plan the stage runs in
fp32, as before.
"""

from __future__ import annotations

import contextlib

import torch

from locomm.config import RunSpec
from locomm.model.stages import Geometry, StageModule, build_stage
from locomm.optim import build_optimizer, cosine_with_warmup
from locomm.train.plan import MemoryPlan


class StageWorker:
    """The model slice, inner optimizer and in-flight micro-batches of one stage replica."""

    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        *,
        geo: Geometry | None = None,
        module: StageModule | None = None,
        device: str | torch.device = "cpu",
        plan: MemoryPlan | None = None,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.geo = geo or Geometry.of(spec)
        self.device = torch.device(device)
        self.module = (module or build_stage(spec, stage, self.geo)).to(self.device)
        self.module.checkpointing = plan is not None and plan.checkpointing
        self.stage = self.module.stage
        self.optimizer = build_optimizer(self.module.parameters(), spec.inner)
        self.micro_per_step = spec.data.batch_size // spec.pipeline.micro_batch_size
        self.pending: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.accumulated = 0
        self.step = 0

    @property
    def first(self) -> bool:
        return self.module.first

    @property
    def last(self) -> bool:
        return self.module.last

    @property
    def step_due(self) -> bool:
        return self.accumulated >= self.micro_per_step

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when the plan asks for it on CUDA (the residual stream sent on stays fp32)."""
        if self.plan is not None and self.plan.autocast and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _input(self, h_in: torch.Tensor | None) -> torch.Tensor | None:
        if self.first:
            return None
        assert h_in is not None
        return h_in.to(self.device, torch.float32).requires_grad_(True)

    # -- micro-batches -------------------------------------------------------------------

    def forward(self, mb: int, tokens: torch.Tensor, h_in: torch.Tensor | None = None) -> torch.Tensor:
        """A non-last stage's forward; keeps the graph until :meth:`backward` (or :meth:`drop`)."""
        assert not self.last, "the last stage runs forward_backward"
        if mb in self.pending:
            raise KeyError(f"micro-batch {mb} is already in flight here")
        self.module.train()
        leaf = self._input(h_in)
        with self.autocast():
            out = self.module(tokens.to(self.device), leaf)
        self.pending[mb] = (leaf, out)
        return out.detach()

    def backward(self, mb: int, g_out: torch.Tensor) -> torch.Tensor | None:
        """Backward of an in-flight micro-batch; returns dL/dh_in (None at stage 0)."""
        leaf, out = self.pending.pop(mb)
        out.backward(g_out.to(self.device, out.dtype))
        self.accumulated += 1
        return None if leaf is None else leaf.grad.detach()

    def forward_backward(
        self, tokens: torch.Tensor, targets: torch.Tensor, h_in: torch.Tensor | None = None
    ) -> tuple[float, torch.Tensor | None]:
        """The last stage: loss and dL/dh_in of one micro-batch in one go (nothing stays in flight)."""
        assert self.last
        self.module.train()
        leaf = self._input(h_in)
        with self.autocast():
            logits = self.module(tokens.to(self.device), leaf)
        loss = StageModule.loss(logits, targets.to(self.device))
        (loss / self.micro_per_step).backward()
        self.accumulated += 1
        return float(loss.detach()), (None if leaf is None else leaf.grad.detach())

    def drop(self, mb: int) -> bool:
        """Forget an in-flight micro-batch whose gradient will never come (lost downstream)."""
        return self.pending.pop(mb, None) is not None

    # -- steps ---------------------------------------------------------------------------

    def drop_accumulated(self) -> None:
        """Forget the gradients accumulated toward the next step (the weights they were taken at are gone)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0

    def lr_at(self, step: int) -> float:
        c = self.spec.inner
        return c.lr * cosine_with_warmup(step, c.warmup_steps, self.spec.train.steps, c.min_lr_ratio)

    def maybe_step(self) -> bool:
        """Step when due and nothing is in flight; returns whether it stepped."""
        if not self.step_due or self.pending:
            return False
        self.apply_step()
        return True

    def apply_step(self) -> None:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.spec.inner.grad_clip > 0 and params:
            torch.nn.utils.clip_grad_norm_(params, self.spec.inner.grad_clip, foreach=True)
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.project_()
        self.accumulated = 0
        self.step += 1


@torch.no_grad()
def eval_mid(w: StageWorker, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    w.module.eval()
    out = w.module(x.to(w.device), None if h is None else h.to(w.device))
    w.module.train()
    return out


@torch.no_grad()
def eval_last(w: StageWorker, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor | None) -> float:
    w.module.eval()
    loss = float(StageModule.loss(w.module(x.to(w.device), h.to(w.device)), y.to(w.device)))
    w.module.train()
    return loss

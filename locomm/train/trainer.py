"""The inner training loop, shared by single-node training, the simulator and the peer daemon.

Notable:
- ``Trainer`` owns one model replica, its inner optimizer, LR schedule and batch
  sampler; ``train_step`` is the whole inner step and fits on one screen. Outer
  algorithms act on ``trainer.model`` between steps and never reach inside.
- On CUDA the forward pass runs under bf16 autocast; the weights and optimizer
  state stay fp32. A :class:`~locomm.train.plan.MemoryPlan` overrides that, and
  sets the micro-batch, gradient accumulation and activation checkpointing: the
  sampler still draws the whole batch, which is split into equal micro-batches
  whose losses are scaled by 1 / accumulation, so the step's gradient is the
  batch's mean gradient whatever the plan.
- Evaluation uses a fixed set of validation windows, so numbers from different
  workers, runs and algorithms are comparable. Loss is in nats per byte (the
  tokenizer is byte-level, so per token = per byte).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from locomm.checkpoint import (
    CHECKPOINT_NAME,
    SPEC_KEY,
    Checkpoint,
    CheckpointError,
    SetAside,
    load_model_tensors,
    model_tensors,
    open_checkpoint,
    save_checkpoint,
)
from locomm.config import RunSpec
from locomm.data import BatchSampler, TokenSplits, eval_batches, load_corpus
from locomm.model import build_model
from locomm.optim import build_optimizer, cosine_with_warmup
from locomm.train.plan import MemoryPlan


def resolve_device(device: str | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or None/'auto' (CUDA when available)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device cuda was asked for, but torch sees no CUDA device (torch {torch.__version__}; a CPU build?)"
        )
    return dev


class Trainer:
    """One worker's model, inner optimizer, schedule and data shard."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        device: str | torch.device = "cpu",
        splits: TokenSplits | None = None,
        worker_id: int = 0,
        num_workers: int = 1,
        stream: int | None = None,
        plan: MemoryPlan | None = None,
    ) -> None:
        if plan is not None and (plan.stage_mode or plan.micro_batch * plan.accumulation != spec.data.batch_size):
            raise ValueError(
                f"memory plan of {plan.accumulation} x {plan.micro_batch} sequences does not cover "
                f"data.batch_size={spec.data.batch_size}"
            )
        self.spec = spec
        self.plan = plan
        self.device = torch.device(device)
        self.accumulation = plan.accumulation if plan else 1
        self.splits = splits if splits is not None else load_corpus(spec.data)
        # Every worker starts from the same weights (the seed is the run's, not the worker's).
        self.model = build_model(spec.model, seed=spec.train.seed, device=self.device)
        self.model.checkpointing = bool(plan and plan.checkpointing)
        self.optimizer = build_optimizer(self.model.parameters(), spec.inner)
        self.sampler = BatchSampler(
            self.splits, spec.data, seed=spec.train.seed, worker_id=worker_id, num_workers=num_workers, stream=stream
        )
        self._val = eval_batches(self.splits.val, spec.data, spec.train.eval_batches)
        self.step = 0
        self.set_aside: SetAside | None = None
        """The unreadable checkpoint the last :meth:`try_resume` renamed aside, if any (for an event log)."""
        self.tokens_per_step = spec.data.batch_size * spec.data.seq_len

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on CUDA (unless the plan turns it off); never on CPU."""
        if self.device.type == "cuda" and (self.plan is None or self.plan.autocast):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def lr_at(self, step: int) -> float:
        c = self.spec.inner
        return c.lr * cosine_with_warmup(step, c.warmup_steps, self.spec.train.steps, c.min_lr_ratio)

    def train_step(self) -> float:
        """One inner step on the next batch; returns the training loss (nats/byte, the batch's mean)."""
        loss = self.compute_gradients()
        self.apply_gradients()
        return loss

    def compute_gradients(self) -> float:
        """Forward and backward on the next batch (the plan's accumulation), leaving its mean gradient in
        ``.grad`` (the optimizer is not stepped); returns the batch's mean training loss (nats/byte).

        A data-parallel sync goes between this and :meth:`apply_gradients` (``sim/scape.py``, islands)."""
        x, y = self.sampler.next()  # the whole batch, as without a plan
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n = self.accumulation
        total = torch.zeros((), device=self.device)
        # Equal micro-batches of a per-token mean loss: the mean of their gradients is the batch's gradient.
        for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
            with self.autocast():
                loss = self.model(xs, ys)
            (loss / n).backward()
            total += loss.detach()
        return (total / n).item()

    def apply_gradients(self) -> None:
        """Clip, set the scheduled LR and step the inner optimizer on the gradients in ``.grad``."""
        if self.spec.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.inner.grad_clip, foreach=True)
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss in nats/byte over the fixed validation windows."""
        self.model.eval()
        total = 0.0
        n = self.accumulation  # micro-batches of equal size: their mean is the batch's mean
        for x, y in self._val:
            for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
                with self.autocast():
                    total += self.model(xs.to(self.device), ys.to(self.device)).item() / n
        return total / len(self._val)

    # -- checkpoints ------------------------------------------------------------------

    def save(
        self, directory: Path, *, aux: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None
    ) -> Path:
        """Checkpoint atomically; ``aux`` tensors and ``extra`` metadata (an outer algorithm's) ride along."""
        path = Path(directory) / CHECKPOINT_NAME
        save_checkpoint(
            path,
            Checkpoint(
                step=self.step,
                spec_hash=self.spec.hash(),
                model=model_tensors(self.model),
                optimizer=self.optimizer.state_dict(),
                extra={"sampler": self.sampler.state(), SPEC_KEY: self.spec.to_toml(), **(extra or {})},
                aux=aux or {},
            ),
        )
        return path

    def try_resume(self, directory: Path) -> Checkpoint | None:
        """Load ``directory``'s checkpoint if there is a readable one and return it; None otherwise.

        Stale temp files of killed writes are swept first; an unreadable checkpoint is renamed aside
        (:attr:`set_aside` says where) and None returned, so a peer falls back to state sync.

        Raises:
            CheckpointError: the checkpoint is of a different run spec (or does not fit the model).
        """
        ckpt, self.set_aside = open_checkpoint(Path(directory), self.spec.hash())
        if ckpt is None:
            return None
        load_model_tensors(self.model, ckpt.model)
        if ckpt.optimizer is not None:
            try:
                self.optimizer.load_state_dict(ckpt.optimizer)
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{directory}: the optimizer state does not fit this model: {e}") from None
        if "sampler" in ckpt.extra:
            self.sampler.set_state(ckpt.extra["sampler"])
        self.step = ckpt.step
        return ckpt


@dataclass
class TrainResult:
    steps: int
    val_loss: float
    unigram_nats: float
    tokens_per_s: float
    train_loss: float
    wall_s: float
    parameters: int
    resumed_from: int

    def as_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["val_bits_per_byte"] = self.val_loss / math.log(2)
        d["unigram_bits_per_byte"] = self.unigram_nats / math.log(2)
        return d


def train(
    spec: RunSpec,
    *,
    device: str | torch.device = "cpu",
    checkpoint_dir: Path | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
    on_eval: Callable[[int, float], None] | None = None,
    plan: MemoryPlan | None = None,
) -> TrainResult:
    """Train one node for ``spec.train.steps`` inner steps, resuming from ``checkpoint_dir`` if it holds one.

    ``on_step(step, loss, tokens_per_s)`` and ``on_eval(step, val_loss)`` report progress. On
    KeyboardInterrupt the current state is checkpointed (when a dir is given) before re-raising.
    """
    trainer = Trainer(spec, device=device, plan=plan)
    resumed = trainer.step if checkpoint_dir and trainer.try_resume(checkpoint_dir) is not None else 0
    c = spec.train
    t0 = time.perf_counter()
    done_tokens = 0
    loss = float("nan")
    try:
        while trainer.step < c.steps:
            loss = trainer.train_step()
            done_tokens += trainer.tokens_per_step
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"training loss became {loss} at step {trainer.step}; lower inner.lr or raise inner.warmup_steps"
                )
            if on_step:
                on_step(trainer.step, loss, done_tokens / (time.perf_counter() - t0))
            if c.eval_interval and trainer.step % c.eval_interval == 0 and trainer.step < c.steps and on_eval:
                on_eval(trainer.step, trainer.evaluate())
            if checkpoint_dir and c.checkpoint_interval and trainer.step % c.checkpoint_interval == 0:
                trainer.save(checkpoint_dir)
    except KeyboardInterrupt:
        if checkpoint_dir:
            trainer.save(checkpoint_dir)
        raise
    wall = time.perf_counter() - t0
    val = trainer.evaluate()
    if on_eval:
        on_eval(trainer.step, val)
    if checkpoint_dir:
        trainer.save(checkpoint_dir)
    return TrainResult(
        steps=trainer.step,
        val_loss=val,
        unigram_nats=trainer.splits.unigram_nats(),
        tokens_per_s=done_tokens / wall if wall > 0 else 0.0,
        train_loss=loss,
        wall_s=wall,
        parameters=trainer.model.num_parameters(),
        resumed_from=resumed,
    )

"""Memory planning: the micro-batch, accumulation, bf16 autocast and checkpointing that fit a peer's memory.

One inner step always covers the run spec's batch (``data.batch_size`` sequences of ``data.seq_len``): a plan
only splits it into ``accumulation`` equal micro-batches, so the gradient is the spec's (see
:meth:`locomm.train.Trainer.train_step`). Planning is arithmetic on the spec, so a plan for ``"cuda"`` can be
made on a machine without a GPU; only the default budget reads the device.

Notable:
- The estimate is an analytic model of :mod:`locomm.model.llama`; the activation terms count the tensors
  autograd saves, in bytes per token (d = d_model, f = d_ff, H = heads, V = vocab):
  per block 44d + 16f + 4H + 8 in fp32 (norms 3 x 4d each, q/k/v/out/wo input 5 x 4d, SDPA's log-sum-exp
  4H, SwiGLU's gate/silu/up/product 4 x 4f); 36d + 8f + 4H + 8 under bf16 autocast (the residual stream
  and norms stay fp32; each linear saves its own bf16 cast of its input), plus bf16 copies of every linear
  weight (autocast's cast cache); with checkpointing 4d per block (its input) and one block recomputed in
  backward. The head adds 12d + 4V (fp32) or 10d + 8V (autocast). Those figures match a CPU
  ``torch.profiler`` count of the forward pass exactly (tests/unit/test_plan.py checks the fp32 one).
- Backward workspace per token: 4f + 16d + 12V bytes in fp32 (the logits' gradients, the residual
  gradient and one SwiGLU gradient more than the saved tensors autograd frees as it goes), half the f part
  under autocast, plus one weight-sized gradient being accumulated.
- Inner optimizer state from ``spec.inner``: adamw and adam keep 2 fp32 states per parameter, adams 1; the
  foreach AdamW step adds one fp32 copy of the parameters while it runs (sqrt of the second moment).
- Search order: the largest micro-batch dividing ``batch_size`` that fits in fp32 without checkpointing;
  else with bf16 autocast (CUDA only: on CPU autocast stays off); else with checkpointing too. Nothing fits
  even at micro-batch 1: :class:`ConfigError` with what it needs and the budget. ``prefer_autocast`` starts
  with autocast on CUDA (faster; what the trainer does without a plan).
- :data:`MARGIN` (10%) of the budget is kept free for the allocator's fragmentation, the CUDA context's
  own allocations, kernels' scratch and the data.
- A pipeline spec (``pipeline.stages > 1``) plans one stage: its micro-batch is ``pipeline.micro_batch_size``
  (the stage accumulates those itself; accumulation 1 here), ``pipeline.in_flight`` of them hold their graph
  at once, and only autocast is planned (stage modules are not checkpointed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from locomm.config import ConfigError, ModelConfig, RunSpec

GIB = 2**30
"""``--max-memory`` is in GiB."""
MARGIN = 0.10
"""Share of the budget a plan keeps free."""


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """How one inner step runs on this peer, and the estimate it was chosen by (bytes)."""

    micro_batch: int
    """Sequences per forward/backward pass."""
    accumulation: int
    """Micro-batches per inner step (micro_batch * accumulation = data.batch_size)."""
    autocast: bool
    """bf16 autocast of the forward pass (CUDA only)."""
    checkpointing: bool
    """Activation checkpointing per decoder block."""
    est_peak_bytes: int
    """The estimated peak of the inner step."""
    budget_bytes: int
    """The memory it may use (``--max-memory``, or the device's free memory)."""
    device: str
    """The device it was planned for."""
    weights_bytes: int
    """fp32 parameters (in pipeline mode: the largest stage's)."""
    grads_bytes: int
    """fp32 gradients."""
    optimizer_bytes: int
    """The inner optimizer's state."""
    cast_bytes: int
    """bf16 copies of the linear weights under autocast."""
    activations_bytes: int
    """Saved activations plus backward workspace of one micro-batch (in pipeline mode: of the in-flight ones)."""
    seq_len: int
    """The spec's tokens per sequence."""
    batch_size: int
    """The spec's sequences per inner step."""
    optimizer: str
    """The inner optimizer and its state, in words."""
    stage_mode: bool = False
    """Planned for one pipeline stage (autocast only)."""
    budget_source: str = "--max-memory"
    """Where the budget came from."""

    @property
    def usable_bytes(self) -> int:
        return int(self.budget_bytes * (1 - MARGIN))

    def describe(self) -> str:
        """A few aligned lines for the user."""

        def g(n: int) -> str:
            return f"{n / GIB:.2f} GiB" if n >= GIB // 2 else f"{n / 2**20:.1f} MiB"

        ac = "bf16" if self.autocast else ("off (CPU: fp32)" if self.device.startswith("cpu") else "off (fp32)")
        if self.stage_mode:
            micro = (
                f"{self.micro_batch} x {self.seq_len} tokens (pipeline.micro_batch_size); the stage accumulates "
                f"{self.batch_size // self.micro_batch} per step (batch {self.batch_size})"
            )
        else:
            micro = f"{self.micro_batch} x {self.seq_len} tokens, accumulation {self.accumulation}"
            micro += f" (batch {self.batch_size})"
        rows = [
            (
                "device",
                f"{self.device}, budget {g(self.budget_bytes)} ({self.budget_source}), "
                f"{MARGIN:.0%} kept free: {g(self.usable_bytes)} usable",
            ),
            ("micro-batch", micro),
            ("autocast", ac),
            ("checkpointing", "on" if self.checkpointing else "off"),
            ("weights", g(self.weights_bytes)),
            ("gradients", g(self.grads_bytes)),
            ("optimizer", f"{g(self.optimizer_bytes)} ({self.optimizer})"),
        ]
        if self.cast_bytes:
            rows.append(("bf16 weights", g(self.cast_bytes)))
        per = "in flight" if self.stage_mode else "per micro-batch"
        rows += [("activations", f"{g(self.activations_bytes)} {per}"), ("estimated peak", g(self.est_peak_bytes))]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["usable_bytes"] = self.usable_bytes
        d["margin"] = MARGIN
        return d


# -- the model of the decoder ---------------------------------------------------------------


def parameter_count(cfg: ModelConfig, layers: int | None = None, *, embed: bool = True, head: bool = True) -> int:
    """Parameters of the decoder (or of ``layers`` blocks with or without the embedding and the head)."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    n = (cfg.n_layers if layers is None else layers) * (4 * d * d + 3 * d * f + 2 * d)
    n += v * d if embed else 0
    n += d + (v * d if not (cfg.tie_embeddings and embed) else 0) if head else 0
    return n


def linear_weights(cfg: ModelConfig, layers: int, *, head: bool = True) -> int:
    """Elements of the weights autocast casts to bf16 (every matmul; the embedding lookup stays fp32)."""
    d, f = cfg.d_model, cfg.d_ff
    return layers * (4 * d * d + 3 * d * f) + (cfg.vocab_size * d if head else 0)


def block_saved(cfg: ModelConfig, autocast: bool) -> int:
    """Bytes per token one block saves for backward."""
    d, f, h = cfg.d_model, cfg.d_ff, cfg.n_heads
    return (36 * d + 8 * f if autocast else 44 * d + 16 * f) + 4 * h + 8


def head_saved(cfg: ModelConfig, autocast: bool) -> int:
    """Bytes per token the final norm, head and cross-entropy save."""
    d, v = cfg.d_model, cfg.vocab_size
    return (10 * d + 8 * v if autocast else 12 * d + 4 * v) + 4


def workspace(cfg: ModelConfig, autocast: bool) -> int:
    """Bytes per token of gradients alive at once in backward."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    return (2 * f if autocast else 4 * f) + 16 * d + 12 * v


def optimizer_state(name: str, params: int) -> tuple[int, int, str]:
    """(state bytes, extra bytes while it steps, label) of the inner optimizer."""
    if name == "adams":
        return 4 * params, 0, "adams: 1 fp32 state"
    return 8 * params, 4 * params, f"{name}: 2 fp32 states"


def estimate(spec: RunSpec, micro_batch: int, *, autocast: bool, checkpointing: bool) -> dict[str, int]:
    """The byte breakdown and the peak of one inner step at ``micro_batch`` sequences per pass."""
    cfg, stages = spec.model, spec.pipeline.stages
    if stages > 1:
        from locomm.model.stages import stage_layers  # noqa: PLC0415 - only pipeline plans need it

        layers = max(len(r) for r in stage_layers(cfg.n_layers, stages, spec.pipeline.layers))
        # The worst stage is bounded by the largest block count with both the embedding and an untied head.
        params = parameter_count(cfg, layers) + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
        copies = micro_batch * spec.pipeline.in_flight
    else:
        layers, params, copies = cfg.n_layers, parameter_count(cfg), micro_batch
    tokens = copies * spec.data.seq_len
    state, step_extra, _ = optimizer_state(spec.inner.name, params)
    weights = grads = 4 * params
    cast = 2 * linear_weights(cfg, layers) if autocast else 0
    if checkpointing:
        # The block inputs, then either the head's tensors or one recomputed block (autograd frees the head's
        # before it reaches the blocks).
        saved = layers * 4 * cfg.d_model + max(block_saved(cfg, autocast), head_saved(cfg, autocast))
    else:
        saved = layers * block_saved(cfg, autocast) + head_saved(cfg, autocast)
    big = max(cfg.d_model * cfg.d_ff, cfg.d_model * cfg.vocab_size)  # one weight gradient being accumulated
    acts = tokens * (saved + workspace(cfg, autocast)) + (6 if autocast else 4) * big
    peak = weights + grads + state + max(cast + acts, step_extra)
    return dict(weights=weights, grads=grads, optimizer=state, cast=cast, activations=acts, peak=peak)


# -- the search --------------------------------------------------------------------------------


def default_budget(device: torch.device) -> tuple[int, str]:
    """The device's free memory in bytes, and where it came from."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--max-memory: torch sees no CUDA device to read free memory from; pass --max-memory")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "free GPU memory"
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
        except (OSError, ValueError, IndexError):
            pass
        raise ConfigError("--max-memory: cannot read MemAvailable from /proc/meminfo; pass --max-memory")
    raise ConfigError(f"--max-memory: no default budget for device {device}; pass --max-memory")


def plan_memory(
    spec: RunSpec, *, device: str | torch.device, max_memory_gb: float | None = None, prefer_autocast: bool = False
) -> MemoryPlan:
    """The plan that fits ``max_memory_gb`` GiB (default: the device's free memory) on ``device``.

    ``prefer_autocast`` (CUDA): try bf16 autocast first (the trainer's behaviour without a plan) instead of
    only where fp32 does not fit.

    Raises:
        ConfigError: the budget is not positive, or nothing fits even at micro-batch 1 with everything on.
    """
    dev = torch.device(device)
    if max_memory_gb is not None:
        if not max_memory_gb > 0:
            raise ConfigError(f"--max-memory: must be > 0, got {max_memory_gb}")
        budget, source = int(max_memory_gb * GIB), "--max-memory"
    else:
        budget, source = default_budget(dev)
    usable = budget * (1 - MARGIN)
    cuda = dev.type == "cuda"
    stage_mode = spec.pipeline.stages > 1
    first = [(True, False)] if cuda and prefer_autocast else [(False, False)] + ([(True, False)] if cuda else [])
    if stage_mode:  # a stage's micro-batch is the spec's; checkpointing (and autocast) is what it can change
        sizes = [spec.pipeline.micro_batch_size]
    else:
        b = spec.data.batch_size
        sizes = [m for m in range(b, 0, -1) if b % m == 0]
    tiers = [*first, (cuda, True)]
    for autocast, ckpt in tiers:
        for m in sizes:
            est = estimate(spec, m, autocast=autocast, checkpointing=ckpt)
            if est["peak"] <= usable:
                return _plan(spec, dev, m, autocast, ckpt, est, budget, source, stage_mode)
    autocast, ckpt = tiers[-1]
    need = estimate(spec, sizes[-1], autocast=autocast, checkpointing=ckpt)["peak"]
    what = ", ".join(n for n, on in (("bf16 autocast", autocast), ("checkpointing", ckpt)) if on) or "fp32"
    raise ConfigError(
        f"--max-memory: the {spec.model.preset} model needs about {need / GIB:.2f} GiB at micro-batch {sizes[-1]} "
        f"({what}), more than {usable / GIB:.2f} GiB usable of the {budget / GIB:.2f} GiB budget "
        f"({MARGIN:.0%} kept free)"
    )


def peer_plan(spec: RunSpec, *, device: str | torch.device, max_memory_gb: float | None = None) -> MemoryPlan | None:
    """The plan a peer trains on (and ``join --plan`` prints): bf16 first on CUDA for the whole model, as the
    trainer always did; a pipeline stage fp32 first. None on a device without a free-memory reading (not CPU,
    not CUDA) when no budget is given: the batch then runs as one step, as before plans."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda") and max_memory_gb is None:
        return None
    return plan_memory(spec, device=dev, max_memory_gb=max_memory_gb, prefer_autocast=spec.pipeline.stages < 2)


def _plan(
    spec: RunSpec,
    dev: torch.device,
    micro: int,
    autocast: bool,
    ckpt: bool,
    est: dict[str, int],
    budget: int,
    source: str,
    stage_mode: bool,
) -> MemoryPlan:
    return MemoryPlan(
        micro_batch=micro,
        accumulation=1 if stage_mode else spec.data.batch_size // micro,
        autocast=autocast,
        checkpointing=ckpt,
        est_peak_bytes=est["peak"],
        budget_bytes=budget,
        device=str(dev),
        weights_bytes=est["weights"],
        grads_bytes=est["grads"],
        optimizer_bytes=est["optimizer"],
        cast_bytes=est["cast"],
        activations_bytes=est["activations"],
        seq_len=spec.data.seq_len,
        batch_size=spec.data.batch_size,
        optimizer=optimizer_state(spec.inner.name, 0)[2],
        stage_mode=stage_mode,
        budget_source=source,
    )

"""The run spec: nested frozen dataclasses, TOML in and out, a stable content hash.

Notable:
- Imports no torch, so the CLI's ``--help`` stays instant.
- Every component owns a frozen, keyword-only config with validation in
  ``__post_init__``; errors are :class:`ConfigError` and name the field
  (``outer.group_size: ...``).
- ``RunSpec.hash()`` is a sha256 over a canonical JSON form of the shared spec,
  so peers can refuse to join a swarm whose spec differs from theirs.
- Local settings (device, ports, paths) are not part of the spec: they live in
  CLI flags and ``LOCOMM_*`` environment variables, never in the hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from locomm import PROTOCOL_VERSION


class ConfigError(ValueError):
    """An invalid run spec value; the message names the field."""


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v > 0, n, f"must be > 0, got {v!r}")


def _fraction(obj: Any, *names: str, closed_low: bool = True, closed_high: bool = True) -> None:
    for n in names:
        v = getattr(obj, n)
        lo_ok = v >= 0 if closed_low else v > 0
        hi_ok = v <= 1 if closed_high else v < 1
        _check(
            lo_ok and hi_ok, n, f"must be in {'[' if closed_low else '('}0, 1{']' if closed_high else ')'}, got {v!r}"
        )


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    _check(v in choices, name, f"must be one of {', '.join(choices)}; got {v!r}")


# --------------------------------------------------------------------------- model

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.11M parameters: unit tests and CI.
    "nano": dict(d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=128),
    # ~6.4M parameters: the CPU default.
    "tiny": dict(d_model=256, n_layers=8, n_heads=8, d_ff=704, max_seq_len=256),
    # ~120M parameters: one consumer GPU.
    "small": dict(d_model=768, n_layers=12, n_heads=12, d_ff=3328, max_seq_len=1024),
    # ~0.93B parameters: a large GPU.
    "base": dict(d_model=2048, n_layers=18, n_heads=16, d_ff=5632, max_seq_len=2048),
}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP."""

    preset: str = "tiny"
    """Name of the size preset these values came from (informational)."""
    vocab_size: int = 264
    """Byte tokenizer: 256 byte values + specials, rounded up to a multiple of 8."""
    d_model: int = 256
    """Width of the residual stream."""
    n_layers: int = 8
    """Number of transformer blocks."""
    n_heads: int = 8
    """Attention heads; d_model must be divisible by it and the head size even (RoPE)."""
    d_ff: int = 704
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "d_ff",
            "max_seq_len",
            "rope_theta",
            "norm_eps",
            "init_std",
        )
        _check(self.vocab_size >= 259, "vocab_size", f"must hold 256 bytes + 3 specials, got {self.vocab_size}")
        _check(
            self.d_model % self.n_heads == 0, "d_model", f"{self.d_model} is not divisible by n_heads={self.n_heads}"
        )
        _check(
            (self.d_model // self.n_heads) % 2 == 0,
            "n_heads",
            f"head size d_model/n_heads={self.d_model // self.n_heads} must be even for rotary embeddings",
        )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The named size preset (nano, tiny, small, base), with optional overrides."""
        if name not in MODEL_PRESETS:
            raise ConfigError(f"model.preset: unknown preset {name!r}; choose from {', '.join(MODEL_PRESETS)}")
        return cls(preset=name, **{**MODEL_PRESETS[name], **overrides})


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    corpus: str = "stdlib"
    """'stdlib' (this Python's own standard library source), a text file or folder,
    a pre-tokenized .bin memmap, or 'hf:NAME[:CONFIG]' for a Hugging Face dataset."""
    bin_dtype: str = "uint16"
    """Token dtype of a .bin corpus: uint16 or uint32."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per inner step (per worker)."""
    val_percent: float = 5.0
    """Share of files (by hash of their path) held out for validation, in percent."""
    max_corpus_mb: float = 64.0
    """Read at most this many MB of text (files in sorted order), to bound memory and start-up."""

    def __post_init__(self) -> None:
        _check(bool(self.corpus), "corpus", "must not be empty")
        _choice(self, "bin_dtype", ("uint16", "uint32"))
        _positive(self, "seq_len", "batch_size", "max_corpus_mb")
        _check(0 < self.val_percent < 100, "val_percent", f"must be in (0, 100), got {self.val_percent}")


# ----------------------------------------------------------------------- optimizer


@dataclass(frozen=True, kw_only=True)
class InnerOptimConfig:
    """The inner (local) optimizer and its schedule."""

    name: str = "adamw"
    """adamw, adam (no weight decay; NoLoCo's inner optimizer) or adams (docs/algorithms.md §5)."""
    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay (ignored by adam)."""
    warmup_steps: int = 50
    """Linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        _choice(self, "name", ("adamw", "adam", "adams"))
        _positive(self, "lr", "eps")
        _fraction(self, "beta1", "beta2", closed_high=False)
        _fraction(self, "min_lr_ratio")
        _check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")


# --------------------------------------------------------------------------- outer

OUTER_ALGOS = ("none", "ddp", "diloco", "noloco", "gasloc", "sparseloco")
GASLOC_TOPOLOGIES = ("matching", "ring", "kpeers", "complete")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer algorithm (docs/algorithms.md §1-4). Defaults are the documented ones."""

    algo: str = "none"
    """none (single node), ddp, diloco, noloco, gasloc or sparseloco."""
    inner_steps: int = 50
    """H: inner steps per outer round."""
    apply_delay_steps: int = 0
    """With overlap, a round's exchange is applied after this many inner steps of the next round (0: all H,
    exactly one round late). Fixed in steps, so the numerics do not depend on the network; a smaller delay
    (Streaming DiLoCo uses a few steps) converges closer to a blocking exchange, and compute waits at that
    step if the exchange has not arrived."""
    lr: float = 0.7
    """Outer learning rate (DiLoCo eta, NoLoCo alpha, GASLoC eta, SparseLoCo alpha)."""
    momentum: float = 0.9
    """DiLoCo Nesterov momentum mu."""
    noloco_beta: float = 0.5
    """NoLoCo momentum beta."""
    noloco_gamma: float | None = None
    """NoLoCo weight on (mean outer weights - own outer weights); None means = lr."""
    group_size: int = 2
    """n: workers per NoLoCo group."""
    gasloc_mix: float = 0.5
    """GASLoC gossip step a (1/2 = exact pair average)."""
    gasloc_gamma: float = 0.0
    """GASLoC momentum gamma on the mixed points. 0 (plain gossip with local steps) was best in
    benchmarks/tune_gasloc.py (4 workers, nano, H=20, 10 rounds): val 2.416 at gamma 0, 2.459 at 0.5,
    2.660 at 0.9 (eta 0.7, a 0.5); raise it for long runs, where acceleration is meant to pay off."""
    gasloc_momentum_on: str = "mixed"
    """Where GASLoC's momentum acts: 'mixed' (z, reproduces DiLoCo on a complete graph) or 'unmixed' (y)."""
    topology: str = "matching"
    """GASLoC graph per round: matching, ring, kpeers or complete."""
    k_peers: int = 2
    """Peers per worker for topology=kpeers."""
    participation: float = 1.0
    """Per-round probability that a worker takes part in the exchange."""
    sparse_density: float = 0.02
    """SparseLoCo top-k density (share of each chunk of 64 that is sent)."""
    sparse_ef_beta: float = 0.95
    """SparseLoCo error-feedback decay."""
    sparse_lr: float = 3.0
    """SparseLoCo outer learning rate alpha. 3.0: the best of the tuning sweep's points run so far under the
    paper's aggregation (benchmarks/results/tune/sparseloco, 8 workers); 1.0 suited the sender-mean rule."""
    sparseloco_aggregation: str = "all"
    """SparseLoCo's mean of the workers' sparse updates: 'all' (the paper's: over every worker of the exchange,
    an index a worker did not send counting as 0) or 'senders' (each index over the workers that sent it)."""
    seed: int = 0
    """Seed of the per-round group permutations (the same on every worker)."""

    def __post_init__(self) -> None:
        _choice(self, "algo", OUTER_ALGOS)
        _choice(self, "topology", GASLOC_TOPOLOGIES)
        _choice(self, "gasloc_momentum_on", ("mixed", "unmixed"))
        _choice(self, "sparseloco_aggregation", ("all", "senders"))
        _check(self.inner_steps >= 1, "inner_steps", f"H must be >= 1, got {self.inner_steps}")
        _check(
            0 <= self.apply_delay_steps <= self.inner_steps,
            "apply_delay_steps",
            f"must be in [0, inner_steps={self.inner_steps}], got {self.apply_delay_steps}",
        )
        _check(self.group_size >= 2, "group_size", f"must be >= 2, got {self.group_size}")
        _check(self.k_peers >= 1, "k_peers", f"must be >= 1, got {self.k_peers}")
        _positive(self, "lr", "sparse_lr")
        _fraction(self, "momentum", "noloco_beta", "gasloc_gamma", "sparse_ef_beta", closed_high=False)
        _fraction(self, "gasloc_mix")
        _fraction(self, "participation", "sparse_density", closed_low=False)

    @property
    def gamma(self) -> float:
        """NoLoCo's consensus weight, defaulting to the outer lr as the public code does."""
        return self.lr if self.noloco_gamma is None else self.noloco_gamma


# --------------------------------------------------------------------- compression

TENSOR_ROLES = ("parameter", "outer_gradient", "activation", "act_gradient")


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Codec stack per tensor role: names joined by '+', lossy first, then lossless."""

    parameter: str = "lossless"
    outer_gradient: str = "lossless"
    activation: str = "subspace+lossless"
    act_gradient: str = "subspace+lossless"
    subspace_rate: int = 32
    """Protocol Models rate: k = d_model / rate."""

    def __post_init__(self) -> None:
        for role in TENSOR_ROLES:
            _check(bool(getattr(self, role)), role, "must name at least one codec")
        _positive(self, "subspace_rate")


# ------------------------------------------------------------------------ pipeline


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline mode (docs/algorithms.md §7): the model split into stages served by different peers."""

    stages: int = 1
    """Number of pipeline stages (1: no pipeline; every peer holds the whole model)."""
    layers: tuple[int, ...] = ()
    """Transformer blocks per stage, e.g. [3, 5]; empty means an even split (earlier stages take the extra)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch; data.batch_size must be a multiple (an optimizer step takes a whole batch)."""
    in_flight: int = 2
    """Micro-batches a stage-0 replica keeps in the pipeline at once (1F1B-style overlap of the stages)."""
    subspace: bool = True
    """Keep the residual stream in span(U) and send z = U^T (h - E_f[tok]) (k = d_model / compression.subspace_rate
    numbers per token); false sends h itself with the activation codec's casts (the uncompressed comparison)."""
    free_tail_layers: int = -1
    """Blocks at the end of the last stage left out of the constraint; -1 (default): the whole last stage.
    Only blocks before the last boundary must write into span(U) for the boundary map to be exact, so every
    value keeps it exact. node0 leaves 2; on tiny at 32x, 2 stages, 311 steps, freeing the whole last stage
    (4 blocks) ends at 1.914 against 1.970 (benchmarks/pipeline.py, tiny32_free vs tiny32)."""
    stage_timeout_s: float = 60.0
    """How long a stage waits for the rest of the pipeline to answer one micro-batch (forward and backward)."""
    reroute_attempts: int = 3
    """Other replicas of the next stage tried for a micro-batch before it counts as lost."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        _positive(self, "stages", "micro_batch_size", "in_flight", "stage_timeout_s")
        _check(self.reroute_attempts >= 0, "reroute_attempts", f"must be >= 0, got {self.reroute_attempts}")
        _check(
            self.free_tail_layers >= -1,
            "free_tail_layers",
            f"must be >= 0, or -1 for the whole last stage; got {self.free_tail_layers}",
        )
        _check(
            all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.layers),
            "layers",
            f"must be positive integers, got {list(self.layers)}",
        )
        _check(
            not self.layers or len(self.layers) == self.stages,
            "layers",
            f"gives {len(self.layers)} stages, stages = {self.stages}",
        )


# ------------------------------------------------------------------------- network


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Timeouts and limits shared by every peer of a run."""

    request_timeout_s: float = 30.0
    """Bound on a small request (a header, a manifest, an answer); transfers are bounded by size instead."""
    stall_timeout_s: float = 20.0
    """A transfer with no progress (no byte read or written) for this long is cut off."""
    min_rate_mbit: float = 10.0
    """Floor rate of a transfer: its deadline is its declared size at this rate (plus slack), and over any
    ``rate_window_s`` of waiting it must move at least this much, so a trickling sender is cut off."""
    rate_window_s: float = 30.0
    max_wait_s: float = 600.0
    """The most a worker waits for a partner's payload beyond the ETA the partner publishes."""
    streams_per_transfer: int = 4
    """A payload above ``parallel_threshold_mb`` travels over up to this many parallel streams to one partner."""
    parallel_threshold_mb: float = 16.0
    max_streams_per_peer: int = 16
    """Open streams one remote peer may hold at once; more are refused with NOT_READY."""
    heartbeat_interval_s: float = 5.0
    heartbeat_ttl_s: float = 30.0
    max_message_mb: float = 1024.0
    """A message larger than this is refused before it is read."""
    max_faults_before_ban: int = 3

    def __post_init__(self) -> None:
        _positive(
            self,
            "request_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_ttl_s",
            "max_message_mb",
            "max_faults_before_ban",
            "stall_timeout_s",
            "min_rate_mbit",
            "rate_window_s",
            "max_wait_s",
            "streams_per_transfer",
            "parallel_threshold_mb",
            "max_streams_per_peer",
        )
        _check(
            self.streams_per_transfer <= 16, "streams_per_transfer", f"must be <= 16, got {self.streams_per_transfer}"
        )
        _check(self.heartbeat_ttl_s > self.heartbeat_interval_s, "heartbeat_ttl_s", "must exceed heartbeat_interval_s")


# --------------------------------------------------------------------------- train


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The inner training loop."""

    steps: int = 2000
    """Total inner steps (the cosine schedule ends here)."""
    seed: int = 0
    """Seeds model init and data order."""
    eval_interval: int = 200
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    eval_batches: int = 16
    """Batches per evaluation (a fixed, deterministic set of windows)."""
    checkpoint_interval: int = 500
    """Checkpoint every this many steps when a checkpoint dir is given (0: only at the end)."""

    def __post_init__(self) -> None:
        _positive(self, "steps", "eval_batches")
        _check(self.eval_interval >= 0, "eval_interval", f"must be >= 0, got {self.eval_interval}")
        _check(self.checkpoint_interval >= 0, "checkpoint_interval", f"must be >= 0, got {self.checkpoint_interval}")


# ------------------------------------------------------------------------ run spec

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerOptimConfig,
    "outer": OuterConfig,
    "compression": CompressionConfig,
    "pipeline": PipelineConfig,
    "network": NetworkConfig,
    "train": TrainConfig,
}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything peers of one run must agree on."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    protocol_version: int = PROTOCOL_VERSION

    SECTIONS: ClassVar[dict[str, type]] = _SECTIONS

    def __post_init__(self) -> None:
        _check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            f"{self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        _check(self.train.steps >= 1, "train.steps", "must be >= 1")
        p = self.pipeline
        if p.stages > 1:
            _check(
                p.stages <= self.model.n_layers,
                "pipeline.stages",
                f"{p.stages} stages for {self.model.n_layers} layers",
            )
            _check(
                not p.layers or sum(p.layers) == self.model.n_layers,
                "pipeline.layers",
                f"sum to {sum(p.layers)}, model.n_layers = {self.model.n_layers}",
            )
            _check(
                self.data.batch_size % p.micro_batch_size == 0,
                "pipeline.micro_batch_size",
                f"{p.micro_batch_size} does not divide data.batch_size={self.data.batch_size}",
            )
            k = self.model.d_model // self.compression.subspace_rate
            _check(
                not p.subspace or k >= 1,
                "compression.subspace_rate",
                f"{self.compression.subspace_rate} leaves no subspace of d_model={self.model.d_model}",
            )

    # -- construction -----------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> RunSpec:
        """A run spec sized for a model preset, with the batch shape that fits it."""
        model = ModelConfig.from_preset(name)
        if name == "nano":
            return cls(
                model=model,
                data=DataConfig(seq_len=128, batch_size=16, max_corpus_mb=8.0),
                inner=InnerOptimConfig(lr=1e-2, warmup_steps=20),
                train=TrainConfig(steps=300, eval_interval=100, eval_batches=8),
            )
        if name == "tiny":
            # Batch 8 x 256 keeps a CPU run under 1 GB resident and gives more steps per minute.
            return cls(
                model=model,
                data=DataConfig(seq_len=256, batch_size=8),
                inner=InnerOptimConfig(lr=2e-3, warmup_steps=50),
                train=TrainConfig(steps=500, eval_interval=100),
            )
        return cls(
            model=model,
            data=DataConfig(seq_len=model.max_seq_len, batch_size=8, max_corpus_mb=256.0),
            inner=InnerOptimConfig(lr=6e-4 if name == "small" else 3e-4, warmup_steps=500),
            train=TrainConfig(steps=20000, eval_interval=1000, checkpoint_interval=1000),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """Build from a nested mapping (a parsed TOML file); unknown keys are errors.

        A ``[model]`` table may name ``preset = "nano"``: the preset's sizes apply and
        the table's other keys override them.
        """
        data = dict(data)
        base = cls.preset(str(data.get("model", {}).get("preset", "tiny")))
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "protocol_version":
                kwargs[key] = value
                continue
            if key not in _SECTIONS:
                raise ConfigError(f"{key}: unknown section; expected one of {', '.join(_SECTIONS)}")
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}: must be a table")
            kwargs[key] = _build_section(key, _SECTIONS[key], getattr(base, key), value)
        try:
            return dataclasses.replace(base, **kwargs)
        except ConfigError:
            raise
        except TypeError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, section: str | None = None, **changes: Any) -> RunSpec:
        """A copy with fields of one section changed, validated; e.g. replace("train", steps=10)."""
        if section is None:
            return dataclasses.replace(self, **changes)
        cur = getattr(self, section)
        return dataclasses.replace(self, **{section: _build_section(section, type(cur), cur, changes)})

    # -- TOML ---------------------------------------------------------------------

    @classmethod
    def from_toml(cls, text: str) -> RunSpec:
        try:
            parsed = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML: {e}") from None
        return cls.from_dict(parsed)

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        return cls.from_toml(p.read_text(encoding="utf-8"))

    def to_toml(self) -> str:
        lines = [f"protocol_version = {self.protocol_version}", ""]
        for name in _SECTIONS:
            lines.append(f"[{name}]")
            section = getattr(self, name)
            for f in fields(section):
                v = getattr(section, f.name)
                if v is None:
                    continue  # TOML has no null; absent means default
                lines.append(f"{f.name} = {_toml_value(v)}")
            lines.append("")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml(), encoding="utf-8")

    # -- identity -----------------------------------------------------------------

    def hash(self) -> str:
        """Stable sha256 of the spec's content (hex). Equal specs hash equal on every machine."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), default=repr)
        return hashlib.sha256(canon.encode()).hexdigest()


def _build_section(name: str, cls: type, base: Any, values: Mapping[str, Any]) -> Any:
    known = {f.name: f for f in fields(cls)}
    for k in values:
        if k not in known:
            raise ConfigError(f"{name}.{k}: unknown field; expected one of {', '.join(known)}")
    if cls is ModelConfig and "preset" in values and values["preset"] != base.preset:
        base = ModelConfig.from_preset(values["preset"])
    checked: dict[str, Any] = {}
    for k, v in values.items():
        checked[k] = _coerce(f"{name}.{k}", known[k].type, v)
    try:
        return dataclasses.replace(base, **checked)
    except ConfigError as e:
        raise ConfigError(f"{name}.{e}") from None


def _coerce(name: str, annotation: Any, v: Any) -> Any:
    """Type-check one TOML value against its field annotation (given as a string)."""
    ann = str(annotation)
    if v is None and "None" in ann:
        return None
    if ann.startswith("bool"):
        if not isinstance(v, bool):
            raise ConfigError(f"{name}: expected true/false, got {v!r}")
        return v
    if ann.startswith("int"):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}: expected an integer, got {v!r}")
        return v
    if ann.startswith("float"):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{name}: expected a finite number, got {v!r}")
        return float(v)
    if ann.startswith("str"):
        if not isinstance(v, str):
            raise ConfigError(f"{name}: expected a string, got {v!r}")
        return v
    return v


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")

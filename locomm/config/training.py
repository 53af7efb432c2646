"""The sections of the run spec that describe one worker's training: model, data, inner optimizer, loop.

Each a frozen, keyword-only dataclass with a docstring per field, validated at construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from locomm.config.base import ConfigError, check, choice, fraction, positive

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
        positive(
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
        check(self.vocab_size >= 259, "vocab_size", f"must hold 256 bytes + 3 specials, got {self.vocab_size}")
        check(self.d_model % self.n_heads == 0, "d_model", f"{self.d_model} is not divisible by n_heads={self.n_heads}")
        check(
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

BUILTIN_CORPORA = ("stdlib",)
"""Corpora every machine has (no path, no download)."""
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?(:[A-Za-z0-9_.-]{1,64})?$")


SHARDINGS = ("iid", "files", "contiguous")
"""data.sharding's values (locomm/data/corpus.py: shard_of)."""


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
    sharding: str = "iid"
    """What each worker draws its windows from: 'iid' (the whole training split, its own generator: a swarm
    sampling one dataset), 'files' (the documents whose path hashes to its shard: a dataset sharded by file)
    or 'contiguous' (its slice of the sorted stream: non-IID, for heterogeneity studies)."""

    def __post_init__(self) -> None:
        check(bool(self.corpus), "corpus", "must not be empty")
        choice(self, "bin_dtype", ("uint16", "uint32"))
        choice(self, "sharding", SHARDINGS)
        positive(self, "seq_len", "batch_size", "max_corpus_mb")
        check(0 < self.val_percent < 100, "val_percent", f"must be in (0, 100), got {self.val_percent}")

    def check_from_swarm(self) -> None:
        """Raise ConfigError unless a spec taken from the swarm (not the user's own --config) may name this
        corpus: a built-in one or a Hugging Face dataset id, never a path on the joiner's disk (a forged
        spec must not make a joiner train on, and gossip, its owner's private files)."""
        c = self.corpus
        if c in BUILTIN_CORPORA:
            return
        name = c[3:] if c.startswith("hf:") else None
        if name is not None and _HF_ID.match(name) and ".." not in name:
            repo = name.split(":", 1)[0]
            if not Path(repo).expanduser().exists():  # datasets would load a local folder of that name
                return
        raise ConfigError(
            f"data.corpus: the swarm's spec names {c!r}; a spec taken from the swarm may name only "
            f"{', '.join(map(repr, BUILTIN_CORPORA))} or a Hugging Face dataset id 'hf:NAME'. To train on "
            "local files, pass --config with a run spec that names them (every peer needs the same spec)"
        )


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
    bias_correction: bool = True
    """adams only: divide the first moment by 1 - beta1^t, previous and new (the build before issue 33); false:
    no correction, AdamS as its paper's equations are quoted (its reference code is not public;
    docs/results/scape.md)."""

    def __post_init__(self) -> None:
        choice(self, "name", ("adamw", "adam", "adams"))
        positive(self, "lr", "eps")
        fraction(self, "beta1", "beta2", closed_high=False)
        fraction(self, "min_lr_ratio")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        check(self.bias_correction or self.name == "adams", "bias_correction", "only adams has a choice of it")


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
        positive(self, "steps", "eval_batches")
        check(self.eval_interval >= 0, "eval_interval", f"must be >= 0, got {self.eval_interval}")
        check(self.checkpoint_interval >= 0, "checkpoint_interval", f"must be >= 0, got {self.checkpoint_interval}")

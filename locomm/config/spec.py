"""The run spec: every section together, TOML in and out, a stable content hash.

``RunSpec.hash()`` is a sha256 over a canonical JSON form of the shared spec, so peers can refuse to
join a swarm whose spec differs from theirs.
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
from locomm.atomic import atomic_write_text
from locomm.config.base import ConfigError, check
from locomm.config.defence import DefenceConfig
from locomm.config.distributed import CompressionConfig, NetworkConfig, OuterConfig, PipelineConfig
from locomm.config.training import DataConfig, InnerOptimConfig, ModelConfig, TrainConfig

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerOptimConfig,
    "outer": OuterConfig,
    "compression": CompressionConfig,
    "pipeline": PipelineConfig,
    "network": NetworkConfig,
    "train": TrainConfig,
    "defence": DefenceConfig,
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
    defence: DefenceConfig = field(default_factory=DefenceConfig)
    protocol_version: int = PROTOCOL_VERSION

    SECTIONS: ClassVar[dict[str, type]] = _SECTIONS

    def __post_init__(self) -> None:
        check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            f"{self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        check(self.train.steps >= 1, "train.steps", "must be >= 1")
        p = self.pipeline
        if p.stages > 1:
            check(
                p.stages <= self.model.n_layers,
                "pipeline.stages",
                f"{p.stages} stages for {self.model.n_layers} layers",
            )
            check(
                not p.layers or sum(p.layers) == self.model.n_layers,
                "pipeline.layers",
                f"sum to {sum(p.layers)}, model.n_layers = {self.model.n_layers}",
            )
            check(
                self.data.batch_size % p.micro_batch_size == 0,
                "pipeline.micro_batch_size",
                f"{p.micro_batch_size} does not divide data.batch_size={self.data.batch_size}",
            )
            k = self.model.d_model // self.compression.subspace_rate
            check(
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
        atomic_write_text(Path(path), self.to_toml())

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

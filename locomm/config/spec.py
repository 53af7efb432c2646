"""The run spec: every section together, TOML in and out, a stable content hash.

``RunSpec.hash()`` is a sha256 over a canonical JSON form of the shared spec, so peers can refuse to
join a swarm whose spec differs from theirs.

Each section is a frozen dataclass whose ``__post_init__`` checks ranges and relations. A value read from
TOML is first type-checked by pydantic against the field's annotation, strictly (TOML's types are exact:
no ``"3"`` for 3, no ``true`` for 1, no ``inf``), list items included; the error names the field and, for a
file, its line. TOML is written by tomli-w.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin, get_type_hints

import tomli_w

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


QUIET_AT_DEFAULT = (("inner", "bias_correction"),)
"""Fields added after runs were started, hashed and written only where a spec sets them off their default (the
section's own default: a section whose defaults a preset changes cannot be listed here)."""


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
    def from_toml(cls, text: str, *, source: str | None = None) -> RunSpec:
        """Parse TOML text; ``source`` (a file name) goes into error messages with the field's line."""
        where = source or "TOML"
        try:
            parsed = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML in {where}: {e}") from None
        try:
            return cls.from_dict(parsed)
        except ConfigError as e:
            line = _line_of(text, str(e).split(":", 1)[0])
            if line is None:
                raise
            raise ConfigError(f"{e} ({where}, line {line})") from None

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        return cls.from_toml(p.read_text(encoding="utf-8"), source=str(p))

    def to_toml(self) -> str:
        # TOML has no null: a None field is left out, and absent means the default.
        doc: dict[str, Any] = {"protocol_version": self.protocol_version}
        for name in _SECTIONS:
            section = getattr(self, name)
            doc[name] = {f.name: v for f in fields(section) if (v := getattr(section, f.name)) is not None}
        for section, name in self._quiet():
            del doc[section][name]
        return tomli_w.dumps(doc)

    def _quiet(self) -> list[tuple[str, str]]:
        """The ``QUIET_AT_DEFAULT`` fields this spec leaves at their default: neither hashed nor written, so a peer
        of a version before them reads the spec (and joins the run) as before."""
        return [
            (section, name)
            for section, name in QUIET_AT_DEFAULT
            if getattr(getattr(self, section), name) == getattr(type(getattr(self, section))(), name)
        ]

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), self.to_toml())

    # -- identity -----------------------------------------------------------------

    def hash(self) -> str:
        """Stable sha256 of the spec's content (hex). Equal specs hash equal on every machine. A field in
        ``QUIET_AT_DEFAULT`` is left out while at its default: adding it changed no run's id."""
        d = self.to_dict()
        for section, name in self._quiet():
            del d[section][name]
        canon = json.dumps(d, sort_keys=True, separators=(",", ":"), default=repr)
        return hashlib.sha256(canon.encode()).hexdigest()


def _build_section(name: str, cls: type, base: Any, values: Mapping[str, Any]) -> Any:
    adapters = _field_types(cls)
    for k in values:
        if k not in adapters:
            raise ConfigError(f"{name}.{k}: unknown field; expected one of {', '.join(adapters)}")
    if cls is ModelConfig and "preset" in values and values["preset"] != base.preset:
        base = ModelConfig.from_preset(values["preset"])
    checked = {k: _validate(f"{name}.{k}", adapters[k], v) for k, v in values.items()}
    try:
        return dataclasses.replace(base, **checked)
    except ConfigError as e:
        raise ConfigError(f"{name}.{e}") from None


def _validate(name: str, adapter: Any, v: Any) -> Any:
    from pydantic import ValidationError

    try:
        return adapter.validate_python(v)
    except ValidationError as e:
        err = e.errors()[0]
        at = "".join(f"[{i}]" for i in err["loc"] if isinstance(i, int))  # the item of a list
        raise ConfigError(f"{name}{at}: {err['msg'][0].lower()}{err['msg'][1:]}, got {err['input']!r}") from None


def _strict(tp: Any) -> Any:
    """The annotation with every scalar strict (TOML values are typed), tuples read from TOML lists."""
    from pydantic import Strict

    if tp in (int, float, bool, str):
        return Annotated[tp, Strict()]
    args = get_args(tp)
    if get_origin(tp) is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple[_strict(args[0]), ...]  # type: ignore[misc]
        return tuple[tuple(_strict(a) for a in args)]  # type: ignore[misc]
    if get_origin(tp) in (Union, types.UnionType):
        return Union[tuple(_strict(a) for a in args)]  # noqa: UP007 - built from a runtime tuple
    return tp


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """One pydantic validator per field of a section, built on first use (pydantic loads lazily: `--help`
    and the config's import stay fast)."""
    from pydantic import ConfigDict, TypeAdapter

    hints = get_type_hints(cls)
    finite = ConfigDict(allow_inf_nan=False)
    return {f.name: TypeAdapter(_strict(hints[f.name]), config=finite) for f in fields(cls)}


def _line_of(text: str, name: str) -> int | None:
    """The 1-based line of ``section.key`` (or of ``[section]``) in TOML text, when it is written plainly."""
    section, _, key = name.partition(".")
    key = key.split("[", 1)[0]
    in_section, header = False, None
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("["):
            in_section = stripped.strip("[] \t") == section
            header = i if in_section and header is None else header
        elif in_section and key and re.match(rf"{re.escape(key)}\s*=", stripped):
            return i
    return None if key else header

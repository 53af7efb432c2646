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

The sections live in :mod:`locomm.config.training` (model, data, inner optimizer, train loop) and
:mod:`locomm.config.distributed` (outer algorithm, compression, pipeline, network), :mod:`locomm.config.defence`
(poisoning defence); :mod:`locomm.config.spec`
puts them together; :mod:`locomm.config.base` holds :class:`ConfigError` and the validators. Every name is
importable from ``locomm.config``.
"""

from locomm.config.base import ConfigError
from locomm.config.defence import DEFENCE_MODES, DefenceConfig
from locomm.config.distributed import (
    GASLOC_TOPOLOGIES,
    OUTER_ALGOS,
    TENSOR_ROLES,
    CompressionConfig,
    NetworkConfig,
    OuterConfig,
    PipelineConfig,
)
from locomm.config.spec import RunSpec
from locomm.config.training import MODEL_PRESETS, DataConfig, InnerOptimConfig, ModelConfig, TrainConfig

__all__ = [
    "DEFENCE_MODES",
    "GASLOC_TOPOLOGIES",
    "MODEL_PRESETS",
    "OUTER_ALGOS",
    "TENSOR_ROLES",
    "CompressionConfig",
    "ConfigError",
    "DataConfig",
    "DefenceConfig",
    "InnerOptimConfig",
    "ModelConfig",
    "NetworkConfig",
    "OuterConfig",
    "PipelineConfig",
    "RunSpec",
    "TrainConfig",
]

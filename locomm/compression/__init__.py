"""Tensor codecs for locomm: one file per codec, one small interface, stacks by name.

Public API::

    codec = get_codec("lossless")                 # or "topk2bit", "bf16+lossless", ...
    data = codec.encode(tensor)                   # bytes
    tensor = codec.decode(data)                   # CodecError on bad input
    choice = codec_choice(TensorRole.PARAMETER, spec.compression)  # the one codec decision
    codec = choice.build()                        # stack "lossless"

Codecs: ``lossless`` (bit-exact exponent coding), ``topk2bit`` (SparseLoCo),
``scape`` (SCAPE masks), ``blockwise8`` (bitsandbytes), ``fp16``/``bf16``
(casts), ``subspace`` (Protocol Models). Stateful codecs (error feedback,
masks) keep their state in the object: build one codec per tensor stream.
Nothing here imports asyncio or sockets; bitsandbytes and numba load lazily
on first use of the codec that needs them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from locomm.compression.base import Codec, CodecError, PartsCodec, TensorRole
from locomm.compression.choice import CodecChoice, codec_choice
from locomm.compression.stack import CodecStack
from locomm.config import CompressionConfig

# name -> "module:Class"; modules import lazily so unused dependencies never load.
_REGISTRY: dict[str, str] = {
    "lossless": "locomm.compression.lossless:LosslessCodec",
    "topk2bit": "locomm.compression.topk2bit:TopK2BitCodec",
    "scape": "locomm.compression.scape:ScapeCodec",
    "blockwise8": "locomm.compression.blockwise8:Blockwise8Codec",
    "fp16": "locomm.compression.cast:Fp16Codec",
    "bf16": "locomm.compression.cast:Bf16Codec",
    "subspace": "locomm.compression.subspace:SubspaceCodec",
}


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec` (join with ``+`` to stack)."""
    return sorted(_REGISTRY)


def codec_class(name: str) -> type[Codec]:
    """The class registered under ``name``."""
    try:
        mod, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(available_codecs())}") from None
    return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return]


def get_codec(name: str, impl: str = "auto", **options: Any) -> Codec:
    """Build a codec, or a stack for ``"a+b+..."`` (lossy stages first, lossless last).

    Options of a single codec are its constructor's keyword arguments. For a
    stack, pass ``{codec_name: {...}}`` per stage, or flat keywords, each of
    which goes to every stage whose constructor accepts it.

    ``impl`` picks the implementation of every stage that has GPU kernels
    (locomm/kernels): ``auto`` (Triton for CUDA tensors, the CPU code for CPU
    tensors), ``cpu``, or ``triton`` (forced; CPU tensors need
    ``TRITON_INTERPRET=1``). The wire bytes do not depend on it, and
    ``decode(data, device=...)`` says where the result goes.

    Raises:
        ValueError: unknown name or impl, or an option no stage accepts.
    """
    from locomm.kernels import check_impl

    check_impl(impl)
    names = [n.strip() for n in name.split("+")]

    def build(n: str, opts: dict[str, Any]) -> Codec:
        cls = codec_class(n)
        if "impl" in inspect.signature(cls.__init__).parameters:
            opts = {"impl": impl, **opts}
        return cls(**opts)

    if len(names) == 1:
        return build(names[0], dict(options))
    per_stage: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in options.items():
        if key in per_stage and isinstance(value, Mapping):
            per_stage[key].update(value)
            continue
        takers = [n for n in names if key in inspect.signature(codec_class(n).__init__).parameters]
        if not takers:
            raise ValueError(f"no stage of {name!r} takes option {key!r}")
        for n in takers:
            per_stage[n][key] = value
    return CodecStack([build(n, per_stage[n]) for n in names])


def codec_for_role(role: TensorRole | str, mapping: Mapping[TensorRole | str, Any] | None = None) -> Codec | None:
    """A fresh codec for ``role``: :func:`codec_choice` under :class:`~locomm.config.CompressionConfig`'s
    stacks, ``mapping`` naming others (``"topk2bit+lossless"``, or ``{"name": ..., **options}``).

    A shorthand for tests; runtime code calls :func:`codec_choice` with ``spec.compression``.
    """
    role = TensorRole(role)
    value = {TensorRole(k): v for k, v in (mapping or {}).items()}.get(role)
    options = dict(value) if isinstance(value, Mapping) else {}
    name = options.pop("name", value if isinstance(value, str) else None)
    compression = CompressionConfig(**{role.value: name}) if name else CompressionConfig()
    return codec_choice(role, compression).build(**options)


__all__ = [
    "Codec",
    "CodecChoice",
    "CodecError",
    "CodecStack",
    "PartsCodec",
    "TensorRole",
    "available_codecs",
    "codec_choice",
    "codec_class",
    "codec_for_role",
    "get_codec",
]

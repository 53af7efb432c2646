"""The codec registry: a codec (or a ``+``-joined stack) by name. Which stack a tensor gets is decided in
:mod:`locomm.compression.choice`; this module only builds it."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from locomm.compression.base import Codec
from locomm.compression.stack import CodecStack

# name -> "module:Class"; modules import lazily so unused dependencies never load.
_REGISTRY: dict[str, str] = {
    "lossless": "locomm.compression.lossless:LosslessCodec",
    "topk2bit": "locomm.compression.topk2bit:TopK2BitCodec",
    "topktiles": "locomm.compression.topk_tiles:TopKTilesCodec",
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


def missing_packages(stack: str) -> list[str]:
    """The optional packages a codec stack needs that are not installed (a codec class's ``requires``)."""
    import importlib.util  # noqa: PLC0415

    names = [n.strip() for n in stack.split("+") if n.strip() in _REGISTRY]  # "none": no codec, nothing needed
    need = {pkg for n in names for pkg in getattr(codec_class(n), "requires", ())}
    return sorted(p for p in need if importlib.util.find_spec(p) is None)


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

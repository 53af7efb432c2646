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

from locomm.compression.base import Codec, CodecError, PartsCodec, TensorRole
from locomm.compression.choice import CodecChoice, codec_choice
from locomm.compression.registry import available_codecs, codec_class, get_codec
from locomm.compression.stack import CodecStack

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
    "get_codec",
]

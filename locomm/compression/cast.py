"""``fp16`` / ``bf16``: plain casts. Lossy (rounding), cheap, and a good first stage
before ``lossless`` (``bf16+lossless``).

``decode`` returns the tensor in the cast dtype; the receiver accumulates in
fp32 (``acc += t.float()``), as docs/algorithms.md §8 says.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from locomm.compression.base import CodecError, PartsCodec, check_part


class CastCodec(PartsCodec):
    """Cast to a narrower float dtype.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    name: ClassVar[str] = "cast"

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cast codec supports float16 and bfloat16, got {dtype}")
        self.dtype = dtype
        self.magic = b"LCF6" if dtype == torch.float16 else b"LCB6"

    def __repr__(self) -> str:
        return f"CastCodec({self.dtype})"

    def encode_parts(self, x: torch.Tensor, **context: Any) -> tuple[bytes, list[torch.Tensor]]:
        if not x.is_floating_point():
            raise TypeError(f"cast codec needs a float tensor, got {x.dtype}")
        # On the tensor's own device: a CUDA tensor is cast there, and the next stage (or serialisation) moves it.
        return b"", [x.detach().to(self.dtype).contiguous()]

    def decode_parts(self, meta: memoryview, parts: list[torch.Tensor], **context: Any) -> torch.Tensor:
        if len(meta) != 0 or len(parts) != 1:
            raise CodecError("cast payload must hold exactly one tensor and no metadata")
        p = parts[0]
        return check_part(parts, 0, p.shape, (self.dtype,))


class Fp16Codec(CastCodec):
    """Cast to float16 (range +-65504: clip-prone for large values)."""

    name: ClassVar[str] = "fp16"

    def __init__(self) -> None:
        super().__init__(torch.float16)


class Bf16Codec(CastCodec):
    """Cast to bfloat16 (fp32 range, 8-bit mantissa)."""

    name: ClassVar[str] = "bf16"

    def __init__(self) -> None:
        super().__init__(torch.bfloat16)

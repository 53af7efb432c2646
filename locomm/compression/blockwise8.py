"""``blockwise8``: bitsandbytes blockwise 8-bit quantization (dynamic map, per-block absmax).

Uses ``bitsandbytes.functional.quantize_blockwise`` / ``dequantize_blockwise``,
which run on CPU. The 256-entry dynamic quantization map is fixed
(``create_dynamic_map()``), so it is not sent; the payload is one uint8 code
per element (metadata) plus one fp32 absmax per block (the float part, which a
stack may pass to ``lossless``). About 8.0x smaller than fp32 at
blocksize 4096, 3.9x than bf16. bitsandbytes is imported lazily: importing
this module does not load it.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import numpy as np
import torch

from locomm.compression.base import CodecError, PartsCodec, Reader, Writer, check_part, code_dtype, dtype_code, numel_of

BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)


@functools.lru_cache(maxsize=1)
def _dynamic_map() -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.create_dynamic_map().float()


class Blockwise8Codec(PartsCodec):
    """Blockwise 8-bit quantization (needs the ``int8`` extra: bitsandbytes).

    Args:
        blocksize: elements per absmax block (64..4096, a power of two).
    """

    name: ClassVar[str] = "blockwise8"
    requires: ClassVar[tuple[str, ...]] = ("bitsandbytes",)
    """Optional packages it needs (``registry.missing_packages`` checks them before a run starts)."""
    magic: ClassVar[bytes] = b"LCB8"

    def __init__(self, blocksize: int = 4096) -> None:
        import importlib.util  # noqa: PLC0415

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("the blockwise8 codec needs bitsandbytes: pip install 'locomm[int8]'")
        if blocksize not in BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
        self.blocksize = blocksize

    def __repr__(self) -> str:
        return f"Blockwise8Codec(blocksize={self.blocksize})"

    def encode_parts(self, x: torch.Tensor, **context: Any) -> tuple[bytes, list[torch.Tensor]]:
        if not x.is_floating_point():
            raise TypeError(f"blockwise8 needs a float tensor, got {x.dtype}")
        flat = x.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        w = Writer()
        w.u8(dtype_code(x.dtype))
        w.shape(x.shape)
        w.u32(self.blocksize)
        if flat.numel() == 0:
            return w.getvalue(), [torch.zeros(0)]
        import bitsandbytes.functional as bnbf

        codes, state = bnbf.quantize_blockwise(flat, code=_dynamic_map(), blocksize=self.blocksize)
        w.raw(codes.numpy().tobytes())
        return w.getvalue(), [state.absmax.float().contiguous()]

    def decode_parts(
        self, meta: memoryview, parts: list[torch.Tensor], max_numel: int | None = None, **context: Any
    ) -> torch.Tensor:
        r = Reader(meta)
        dtype = code_dtype(r.u8())
        if not dtype.is_floating_point:
            raise CodecError(f"blockwise8 payload claims non-float dtype {dtype}")
        shape = r.shape(max_numel)
        blocksize = r.u32()
        if blocksize not in BLOCKSIZES:
            raise CodecError(f"bad blocksize {blocksize}")
        n = numel_of(shape)
        codes = r.array(n, np.uint8)  # size-checked before any allocation
        r.expect_end()
        n_blocks = -(-n // blocksize)
        absmax = check_part(parts, 0, (n_blocks,), (torch.float32,))
        if len(parts) != 1:
            raise CodecError("blockwise8 payload must hold exactly one float part")
        if n == 0:
            return torch.zeros(shape, dtype=dtype)
        import bitsandbytes.functional as bnbf

        out = bnbf.dequantize_blockwise(
            torch.from_numpy(codes.copy()), absmax=absmax.contiguous(), code=_dynamic_map(), blocksize=blocksize
        )
        return out.reshape(shape).to(dtype)

    @staticmethod
    def max_abs_error(absmax: float) -> float:
        """Bound on |x - decode(encode(x))| in a block with this absmax: the widest
        step of the dynamic map, scaled (a value always lands on one of its two
        neighbouring levels; round-to-nearest would halve this)."""
        return _widest_step() * absmax


@functools.lru_cache(maxsize=1)
def _widest_step() -> float:
    code = _dynamic_map().double().sort().values
    return float((code[1:] - code[:-1]).max())

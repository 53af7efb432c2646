"""What crosses a stage boundary, coded with the run's role-aware codecs (sans-IO: bytes in, tensors out).

Forward: the token window (B, T+1) as uint16 (the next stages rebuild E_f[tok] from the
inputs and the last stage takes its targets from it), then the residual stream h through
``compression.activation`` (``subspace+lossless``: z = U^T (h - E_f[tok]), k numbers per
token, lossless-coded). Backward: dL/dh through ``compression.act_gradient``
(``subspace+lossless``: U^T dL/dh). Without the subspace (``pipeline.subspace = false``)
the ``subspace`` stage is dropped from both stacks and h travels whole. Those stacks, and the
raw token window, are :func:`~locomm.compression.choice.codec_choice`'s.

The simulator and the stage server both code through :class:`BoundaryCoder`, so they
count the same bytes and see the same rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from locomm.compression.base import Codec, CodecError, TensorRole
from locomm.compression.choice import RAW, codec_choice
from locomm.config import RunSpec
from locomm.model.stages import Geometry

TOKEN_DTYPE = np.uint16


class NonFinite(ValueError):
    """A decoded activation or gradient holds NaN or inf."""


class BoundaryCoder:
    """Encodes and decodes one boundary's activations, gradients and token windows."""

    def __init__(self, spec: RunSpec, geo: Geometry) -> None:
        if spec.model.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
            raise ValueError(f"token ids travel as uint16; vocab_size {spec.model.vocab_size} is too large")
        self.geo = geo
        self.vocab_size = spec.model.vocab_size
        self.choices = {
            role: codec_choice(role, spec.compression, boundary=geo)
            for role in (TensorRole.ACTIVATION, TensorRole.ACT_GRADIENT, TensorRole.TOKENS)
        }
        assert self.choices[TensorRole.TOKENS].stack == RAW  # windows travel as raw uint16 ids
        self.act_stack = self.choices[TensorRole.ACTIVATION].stack
        self.grad_stack = self.choices[TensorRole.ACT_GRADIENT].stack
        self.act = self._build(TensorRole.ACTIVATION)
        self.grad = self._build(TensorRole.ACT_GRADIENT)

    def _build(self, role: TensorRole) -> Codec:
        codec = self.choices[role].build()
        if codec is None:
            raise ValueError(f"compression.{role.value}: a boundary tensor needs a codec, not raw bytes")
        return codec

    # -- token windows -------------------------------------------------------------------

    def encode_window(self, window: torch.Tensor) -> bytes:
        """(B, T+1) token ids -> uint16 bytes."""
        return window.to("cpu", torch.int64).numpy().astype(TOKEN_DTYPE).tobytes()

    def decode_window(self, data: bytes | bytearray | memoryview, batch: int, seq: int) -> torch.Tensor:
        """uint16 bytes -> (B, T+1) int64; CodecError on a wrong size or an id out of range."""
        want = batch * (seq + 1) * np.dtype(TOKEN_DTYPE).itemsize
        if len(data) != want:
            raise CodecError(f"token window of {len(data)} bytes, expected {want}")
        arr = np.frombuffer(bytes(data), dtype=TOKEN_DTYPE).astype(np.int64).reshape(batch, seq + 1)
        if arr.size and int(arr.max()) >= self.vocab_size:
            raise CodecError(f"token id {int(arr.max())} out of range [0, {self.vocab_size})")
        return torch.from_numpy(arr)

    # -- tensors -------------------------------------------------------------------------

    def encode_activation(self, h: torch.Tensor, tokens: torch.Tensor) -> bytes:
        return self.act.encode(h.detach().float().contiguous(), tokens=tokens)

    def decode_activation(self, data: bytes | bytearray | memoryview, tokens: torch.Tensor) -> torch.Tensor:
        return self._decode(self.act, data, tokens, "activation")

    def encode_gradient(self, g: torch.Tensor, tokens: torch.Tensor) -> bytes:
        return self.grad.encode(g.detach().float().contiguous(), tokens=tokens)

    def decode_gradient(self, data: bytes | bytearray | memoryview, tokens: torch.Tensor) -> torch.Tensor:
        return self._decode(self.grad, data, tokens, "gradient")

    def _decode(
        self, codec: Codec, data: bytes | bytearray | memoryview, tokens: torch.Tensor, what: str
    ) -> torch.Tensor:
        """Decode and check against the micro-batch: CodecError for anything a peer could have sent wrong."""
        try:
            # Bounded by the micro-batch's own size: a larger declaration is refused before it is allocated.
            x = codec.decode(data, tokens=tokens, max_numel=tokens.numel() * self.geo.d)
        except CodecError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure on foreign bytes is a bad payload
            raise CodecError(f"{what}: {type(e).__name__}: {e}") from None
        want = (*tokens.shape, self.geo.d)
        if tuple(x.shape) != want:
            raise CodecError(f"{what} of shape {tuple(x.shape)}, expected {want}")
        x = x.float()
        if not torch.isfinite(x).all():
            raise NonFinite(f"{what} holds non-finite values")
        return x

    def max_activation_bytes(self, batch: int, seq: int) -> int:
        """The most bytes an activation (or gradient) of a micro-batch may take: raw fp32 h plus slack."""
        return int(batch * seq * self.geo.d * 4 * 1.1) + 65536

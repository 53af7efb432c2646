"""Triton GPU kernels for the hot paths, each tested against the CPU code it replaces.

One file per kernel family:

- ``lossless``: the exponent coder's histogram, lane sizing, encode and decode
  (the segmented layout, version 2 of ``LosslessCodec``'s wire format);
- ``topk2bit``: SparseLoCo's error feedback, chunked top-k and 2-bit packing;
- ``subspace``: Protocol Models' z = U^T (h - E_f[tok]), h = U z + E_f[tok]
  with the bf16 cast fused, and the weight projections after an optimizer step;
- ``model``: fused RMSNorm (+ residual add), SwiGLU and cross-entropy, with
  autograd, for the model's opt-in fused path;
- ``crc32``: zlib's CRC-32 of a device buffer (the payload checksum), so a
  GPU-coded payload is never checked on one host core;
- ``lossless_cpu``: the numba CPU coder of the lossless codec (both layouts),
  the reference the Triton kernels are tested against.

Kernels are launchers over arrays and integers: they import nothing from the
compression package (which plans the wire format and calls them), and a
stream they cannot decode raises :class:`StreamError`, which the codecs
turn into their ``CodecError``.

``python -m locomm.kernels.compile_check`` compiles every kernel for sm_80 and
sm_90 without a GPU (the tests run it for sm_90).

The dispatch point is :func:`resolve_impl`: codecs take ``impl`` in ``auto``
(CUDA tensors take the Triton kernels, CPU tensors the numba/torch code),
``cpu`` or ``triton`` (forced). Under ``TRITON_INTERPRET=1`` the Triton
kernels run on CPU tensors, which is how the tests check them on a machine
with no GPU; the variable must be set before the kernel modules are imported
(``@triton.jit`` reads it when it decorates). Both implementations write the
same wire bytes. Triton itself is the optional ``gpu`` extra: nothing here
imports it until a kernel is used.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "cpu", "triton")


class StreamError(ValueError):
    """A coded stream a kernel cannot decode; ``code`` is 1 (invalid code), 2 (a lane ran past its end),
    3 (a lane has unread bytes) or 4 (a lane plan outside the arrays it was given)."""

    MESSAGES = {
        1: "invalid code in stream",
        2: "coded stream truncated",
        3: "trailing bytes after coded stream",
        4: "lane plan outside the stream or output",
    }

    def __init__(self, code: int) -> None:
        super().__init__(self.MESSAGES.get(code, f"decoder error {code}"))
        self.code = code


KERNEL_MODULES = ("crc32", "lossless", "topk2bit", "subspace", "model")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``: CPU tensors, no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def check_impl(impl: str) -> str:
    """Validate an ``impl`` argument; raises ValueError for anything but auto, cpu or triton."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    return impl


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """``"cpu"`` or ``"triton"`` for work on ``device``.

    ``auto`` takes Triton for CUDA devices when triton is installed, the CPU
    code otherwise. ``triton`` insists: it raises RuntimeError when triton is
    missing, or when ``device`` is a CPU device outside the interpreter.
    """
    dev = torch.device(device)
    if impl == "cpu":
        return "cpu"
    if impl == "auto":
        return "triton" if dev.type == "cuda" and triton_available() and _capable(dev.index) else "cpu"
    check_impl(impl)
    if not triton_available():
        raise RuntimeError("impl='triton' needs the triton package: pip install 'locomm[gpu]'")
    if dev.type != "cuda" and not interpreting():
        raise RuntimeError(f"impl='triton' on a {dev.type} tensor needs TRITON_INTERPRET=1 (the Triton interpreter)")
    return "triton"


MIN_CAPABILITY = (7, 5)
"""Oldest CUDA compute capability ``auto`` sends to Triton (Turing); older GPUs keep the CPU code."""


@functools.lru_cache(maxsize=16)
def _capable(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def load_all() -> None:
    """Import every kernel module now (so ``@triton.jit`` sees the current TRITON_INTERPRET)."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"locomm.kernels.{name}")


__all__ = [
    "IMPLS",
    "KERNEL_MODULES",
    "StreamError",
    "check_impl",
    "interpreting",
    "load_all",
    "resolve_impl",
    "triton_available",
]

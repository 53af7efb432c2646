"""One role-aware payload codec for the simulator and the daemon.

An outer algorithm's payload is a dict of named tensors, ``"{prefix}/{param}"``.
Each prefix has a :class:`TensorRole` (``phi`` and ``theta`` are parameters,
``delta`` an outer gradient, ...); :func:`~locomm.compression.choice.codec_choice`
reads the codec stack of each role from the run spec's ``compression`` section
(``lossless``, ``bf16+lossless``, ...). A payload travels as *parts*: flat runs
of at most ``part_elems`` elements of one tensor,
each encoded on its own with that tensor's stack, so a sender encodes part k+1
while part k is on the wire and a receiver decodes parts as they arrive into a
tensor it allocated once (the payload's size, nothing more).

Values that an algorithm already encoded with a stateful codec (SparseLoCo's
top-k with error feedback keeps its residual as algorithm state) are bytes; they
travel as byte runs of the same size and are decoded once, whole, on arrival,
with a stateless instance of the algorithm's codec.

The simulator calls :meth:`PayloadCodec.transmit`, which goes through exactly the
encode/decode path of the daemon, so both count the same bytes and see the same
rounding (a ``bf16`` stage gives the receiver bf16 tensors in both).

Sans-IO: no sockets, no threads, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from locomm.compression.base import Codec, CodecError, OversizeError, TensorRole, tensor_bytes, tensor_from_bytes
from locomm.compression.choice import codec_choice
from locomm.compression.registry import available_codecs, codec_class, get_codec, missing_packages

PART_ELEMS = 1 << 20
"""Default elements per part (4 MiB of fp32)."""
MIN_PART_ELEMS = 1 << 12
MAX_PART_ELEMS = 1 << 24

_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


class PayloadError(ValueError):
    """A payload part that breaks its declared layout or fails to decode; carries a short reason."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "shape" | "payload" | "finite"


def allowed_stack(name: str) -> bool:
    """Whether ``name`` is a stack of registered codecs ("none" means raw bytes)."""
    if name == "none":
        return True
    names = name.split("+")
    return bool(names) and all(n in available_codecs() for n in names)


def wire_dtype(stack: str, source: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a receiver gets for a tensor sent with ``stack``: a cast's dtype, else the source's."""
    first = stack.split("+")[0]
    return _CAST_DTYPES.get(first, source)


@dataclass(frozen=True)
class TensorPlan:
    """How one payload tensor travels."""

    name: str
    shape: tuple[int, ...]
    codec: str
    dtype: str
    """The dtype the receiver gets ("float32", "bfloat16", "float16")."""
    encoded: bool = False
    """True: the value is bytes already encoded by the algorithm (parts are byte runs)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def max_bytes(self) -> int:
        """Upper bound on the encoded size: for a value the algorithm encoded, its codec's own bound when it
        has one (``topk2bit``: one byte per element); else the raw fp32 size plus framing slack."""
        if self.encoded and "+" not in self.codec and self.codec != "none":
            bound = getattr(codec_class(self.codec), "max_encoded_bytes", None)
            if bound is not None:
                return int(bound(self.numel, len(self.shape)))
        return int(self.numel * 4 * 1.1) + 65536


@dataclass(frozen=True)
class Part:
    tensor: int
    """Index into the sorted tensor list."""
    start: int
    """Element offset (byte offset for encoded values)."""
    count: int


def split(total: int, size: int) -> list[tuple[int, int]]:
    """Canonical (start, count) runs of ``size`` covering ``total`` (one empty run for 0)."""
    if total == 0:
        return [(0, 0)]
    return [(s, min(size, total - s)) for s in range(0, total, size)]


class PayloadCodec:
    """Encodes and decodes one algorithm's payloads part by part.

    Args:
        shapes: parameter name -> shape.
        roles: payload prefix -> tensor role ("parameter", "outer_gradient", ...).
        compression: ``spec.compression`` (or a mapping role -> stack); :func:`codec_choice` picks each stack.
        encoded: payload prefix -> codec stack of values the algorithm encodes itself (bytes): the
            algorithm's ``payload_encoded``, which :func:`codec_choice` gave it.
        part_elems: elements per part.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        roles: Mapping[str, str],
        compression: Any,
        encoded: Mapping[str, str] | None = None,
        part_elems: int = PART_ELEMS,
    ) -> None:
        if not MIN_PART_ELEMS <= part_elems <= MAX_PART_ELEMS:
            raise ValueError(f"part_elems must be in [{MIN_PART_ELEMS}, {MAX_PART_ELEMS}], got {part_elems}")
        self.part_elems = part_elems
        encoded = dict(encoded or {})
        plans = []
        for prefix, role in roles.items():
            role = TensorRole(role).value
            # The algorithm's own codec (SparseLoCo's, which it took from codec_choice), else the run's.
            stack = encoded.get(prefix) or codec_choice(role, compression).stack
            if not allowed_stack(stack):
                raise ValueError(
                    f"compression.{role}: unknown codec stack {stack!r}; codecs: {', '.join(available_codecs())}"
                )
            if missing := missing_packages(stack):  # before any round: a codec that cannot load is a setup error
                raise ValueError(
                    f"compression.{role}: {stack!r} needs {', '.join(missing)}: pip install 'locomm[int8]'"
                )
            for k, shape in shapes.items():
                dt = torch.float32 if prefix in encoded else wire_dtype(stack)
                plans.append(
                    TensorPlan(
                        f"{prefix}/{k}",
                        tuple(int(s) for s in shape),
                        stack,
                        _DTYPE_NAMES[dt],
                        encoded=prefix in encoded,
                    )
                )
        self.tensors: list[TensorPlan] = sorted(plans, key=lambda t: t.name)
        self.index = {t.name: i for i, t in enumerate(self.tensors)}
        self._codecs: dict[str, Codec | None] = {}

    # -- layout ------------------------------------------------------------------------

    def codec(self, stack: str) -> Codec | None:
        """A stateless codec for ``stack`` (None: raw bytes). Encoding and decoding only read it."""
        if stack not in self._codecs:
            self._codecs[stack] = None if stack == "none" else get_codec(stack)
        return self._codecs[stack]

    def parts(self, nbytes: Mapping[str, int] | None = None) -> list[Part]:
        """The canonical parts of a payload; encoded tensors need their byte length in ``nbytes``."""
        out = []
        for i, t in enumerate(self.tensors):
            if t.encoded:
                n = (nbytes or {}).get(t.name)
                if n is None:
                    raise KeyError(f"{t.name}: the byte length of an encoded value is needed")
                runs = split(n, self.part_elems * 4)
            else:
                runs = split(t.numel, self.part_elems)
            out.extend(Part(i, s, c) for s, c in runs)
        return out

    def max_part_bytes(self, part: Part) -> int:
        t = self.tensors[part.tensor]
        if t.encoded:
            return part.count
        return int(part.count * 4 * 1.1) + 4096

    def raw_bytes(self) -> int:
        """Bytes of the payload before lossless coding (after casts); encoded values not counted."""
        return sum(t.numel * WIRE_DTYPES[t.dtype].itemsize for t in self.tensors if not t.encoded)

    def check_names(self, payload: Mapping[str, Any]) -> None:
        if set(payload) != set(self.index):
            missing, extra = set(self.index) - set(payload), set(payload) - set(self.index)
            raise KeyError(
                f"payload tensors differ from the plan: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"
            )

    # -- encode ------------------------------------------------------------------------

    def encode_part(self, payload: Mapping[str, Any], part: Part) -> bytes:
        t = self.tensors[part.tensor]
        v = payload[t.name]
        if t.encoded:
            return bytes(memoryview(v)[part.start : part.start + part.count])
        flat = v.detach().reshape(-1)[part.start : part.start + part.count]
        codec = self.codec(t.codec)
        if codec is None:
            return bytes(tensor_bytes(flat.to(WIRE_DTYPES[t.dtype])))
        return codec.encode(flat.contiguous())

    # -- decode ------------------------------------------------------------------------

    def allocate(self, nbytes: Mapping[str, int] | None = None) -> dict[str, Any]:
        """Destinations for one incoming payload: tensors of the wire dtype, bytearrays for encoded values
        (of the sender's declared length, refused above the plan's own bound)."""
        out: dict[str, Any] = {}
        for t in self.tensors:
            if t.encoded:
                n = (nbytes or {})[t.name]
                if not 0 <= n <= t.max_bytes():
                    raise PayloadError("shape", f"{t.name}: {n} bytes declared, at most {t.max_bytes()} expected")
                out[t.name] = bytearray(n)
            else:
                out[t.name] = torch.empty(t.shape, dtype=WIRE_DTYPES[t.dtype])
        return out

    def decode_part(self, dest: Mapping[str, Any], part: Part, data: bytes | bytearray | memoryview) -> None:
        """Decode one part into ``dest``; raises :class:`PayloadError`."""
        t = self.tensors[part.tensor]
        if t.encoded:
            if len(data) != part.count:
                raise PayloadError("shape", f"{t.name}: {len(data)} bytes for a run of {part.count}")
            dest[t.name][part.start : part.start + part.count] = data
            return
        want = WIRE_DTYPES[t.dtype]
        codec = self.codec(t.codec)
        if codec is None:
            if len(data) != part.count * want.itemsize:
                raise PayloadError("shape", f"{t.name}: {len(data)} bytes for {part.count} values")
            x = tensor_from_bytes(data, want, (part.count,))
        else:
            try:
                x = codec.decode(data, max_numel=part.count)  # a larger claim is refused before allocating
            except OversizeError as e:
                raise PayloadError("shape", f"{t.name}: {e}") from None
            except CodecError as e:
                raise PayloadError("payload", f"{t.name}: {e}") from None
            except Exception as e:  # noqa: BLE001 - any codec failure on foreign bytes is a bad payload
                raise PayloadError("payload", f"{t.name}: {type(e).__name__}: {e}") from None
            if x.numel() != part.count:
                raise PayloadError("shape", f"{t.name}: {x.numel()} values for a part of {part.count}")
            if x.dtype != want:
                raise PayloadError("payload", f"{t.name}: decoded {x.dtype}, the run sends {want}")
        x = x.reshape(-1)
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise PayloadError("finite", f"{t.name}: non-finite values")
        dest[t.name].view(-1)[part.start : part.start + part.count].copy_(x)

    def finish(self, dest: dict[str, Any]) -> dict[str, Any]:
        """Decode encoded values (whole) once all their runs arrived; returns {name: tensor}."""
        for t in self.tensors:
            if not t.encoded:
                continue
            codec = self.codec(t.codec)
            try:
                x = codec.decode(bytes(dest[t.name]), max_numel=t.numel) if codec is not None else None
            except OversizeError as e:
                raise PayloadError("shape", f"{t.name}: {e}") from None
            except Exception as e:  # noqa: BLE001 - foreign bytes
                raise PayloadError("payload", f"{t.name}: {type(e).__name__}: {e}") from None
            if x is None or x.numel() != t.numel:
                raise PayloadError(
                    "shape", f"{t.name}: decoded {None if x is None else x.numel()} values for {t.shape}"
                )
            x = x.float().reshape(t.shape)
            if not torch.isfinite(x).all():
                raise PayloadError("finite", f"{t.name}: non-finite values")
            dest[t.name] = x
        return dest

    def warm_up(self) -> None:
        """Encode and decode a small tensor with every stack once (numba compiles its kernels on first use:
        seconds that must not land inside a transfer's deadline)."""
        for stack in sorted({t.codec for t in self.tensors if not t.encoded}):
            codec = self.codec(stack)
            if codec is not None:
                x = torch.linspace(-1, 1, 4096)
                codec.decode(codec.encode(x))

    # -- the simulator's path ----------------------------------------------------------

    def coded_bytes(self, payload: Mapping[str, Any]) -> int:
        """The bytes ``payload`` would take on the wire (encoded, not decoded: a count only)."""
        self.check_names(payload)
        return sum(len(self.encode_part(payload, part)) for part in self.parts(self._encoded_bytes(payload)))

    def _encoded_bytes(self, payload: Mapping[str, Any]) -> dict[str, int]:
        return {t.name: len(payload[t.name]) for t in self.tensors if t.encoded}

    def transmit(self, payload: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """What a receiver gets, and the bytes on the wire: the daemon's encode/decode, in process."""
        self.check_names(payload)
        nbytes = self._encoded_bytes(payload)
        dest = self.allocate(nbytes)
        total = 0
        for part in self.parts(nbytes):
            data = self.encode_part(payload, part)
            total += len(data)
            self.decode_part(dest, part, data)
        return self.finish(dest), total

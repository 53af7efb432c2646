"""The one codec decision: which stack a tensor travels with, from its role and ``spec.compression``.

=================  ===============  ==========================================================
role               where            stack
=================  ===============  ==========================================================
parameter          outer payloads   ``compression.parameter``
outer_gradient     outer payloads   ``compression.outer_gradient``; under SparseLoCo
                                    (``outer.algo == "sparseloco"``) ``topk2bit`` at
                                    ``outer.sparse_density`` with error feedback
                                    ``outer.sparse_ef_beta``, encoded by the algorithm
activation         stage boundary   ``compression.activation``, ``subspace`` first when the
                                    boundary keeps the subspace, dropped when it does not
act_gradient       stage boundary   ``compression.act_gradient``, the same way
tokens             stage boundary   ``none``: raw uint16 ids (not configurable)
=================  ===============  ==========================================================

:class:`~locomm.compression.payload.PayloadCodec`,
:class:`~locomm.compression.boundary.BoundaryCoder` and
:class:`~locomm.protocol.sparseloco.SparseLoCo` all ask :func:`codec_choice`, so the simulator
and the daemon code every tensor the same way. Sans-IO; building a codec is left to
:meth:`CodecChoice.build`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from locomm.compression.base import Codec, TensorRole
from locomm.config import CompressionConfig, OuterConfig

if TYPE_CHECKING:
    from locomm.model.stages import Geometry

RAW = "none"
"""The stack name of raw bytes: no codec."""

_BOUNDARY_KIND = {TensorRole.ACTIVATION: "activation", TensorRole.ACT_GRADIENT: "gradient"}


@dataclass(frozen=True)
class CodecChoice:
    """The codec stack of one tensor role, and what building it takes."""

    role: TensorRole
    stack: str
    """Codec names joined by '+' (lossy first, lossless last), or ``"none"`` for raw bytes."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword options of :func:`~locomm.compression.get_codec` for the sender's codec."""
    encoded: bool = False
    """True: the outer algorithm encodes the value itself with a stateful codec built from this choice
    (SparseLoCo keeps its error feedback there); the transport moves those bytes and a receiver decodes
    them with a stateless instance of ``stack``."""

    def build(self, **extra: Any) -> Codec | None:
        """A fresh codec (stateful codecs: one per tensor stream); None for raw bytes."""
        if self.stack == RAW:
            return None
        from locomm.compression.registry import get_codec  # noqa: PLC0415

        return get_codec(self.stack, **{**self.options, **extra})


def codec_choice(
    role: TensorRole | str,
    compression: CompressionConfig | Mapping[str, str],
    *,
    outer: OuterConfig | None = None,
    boundary: Geometry | None = None,
) -> CodecChoice:
    """The codec stack for a tensor of ``role`` under the run's ``compression`` section.

    Args:
        role: what the tensor is (a :class:`TensorRole` or its value).
        compression: ``spec.compression``, or a mapping role -> stack (benchmarks and tests).
        outer: ``spec.outer``, where an outer algorithm encodes its payload itself (SparseLoCo);
            without it an outer gradient takes ``compression.outer_gradient``.
        boundary: the pipeline's geometry, for the tensors that cross a stage boundary: it says
            whether the ``subspace`` stage is in the stack and gives its basis. Without it an
            activation's stack is the one ``compression`` names, unchanged.

    Raises:
        ValueError: ``role`` is not a tensor role.
    """
    role = TensorRole(role)
    if role is TensorRole.TOKENS:
        return CodecChoice(role, RAW)
    if role is TensorRole.OUTER_GRADIENT and outer is not None and outer.algo == "sparseloco":
        options = {"density": outer.sparse_density, "beta": outer.sparse_ef_beta}
        return CodecChoice(role, "topk2bit", options, encoded=True)
    named = compression[role.value] if isinstance(compression, Mapping) else getattr(compression, role.value)
    if boundary is None or role not in _BOUNDARY_KIND:
        return CodecChoice(role, named)
    names = [n.strip() for n in named.split("+")]
    if not boundary.subspace:
        return CodecChoice(role, "+".join(n for n in names if n != "subspace") or "lossless")
    if names[0] != "subspace":
        names = ["subspace", *names]
    subspace = {
        "d": boundary.d,
        "k": boundary.k,
        "vocab_size": boundary.vocab_size,
        "seed": boundary.seed,
        "fixed_std": boundary.fixed_std,  # E_f's scale: the stages' own (pipeline.fixed_embed_std)
        "kind": _BOUNDARY_KIND[role],
        "include_tokens": False,  # the token window travels on its own (role tokens)
    }
    return CodecChoice(role, "+".join(names), {"subspace": subspace})

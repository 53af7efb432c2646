"""SCAPE's per-step sync of an island (Zheng et al. 2026, arXiv 2607.01678; docs/algorithms.md §5).

An island is a few workers on a fast link that train as one data-parallel worker: every inner step they
synchronize one sparse gradient buffer and each steps its own AdamS on it, so they stay identical. One
worker's step ``t`` (sans-IO: the transport moves the messages; ``sim/scape.py`` and ``peer/island/member.py``):

    msg    = sync.plan(grads, first_moment)   # u = g + r (error feedback); send u on M_t, r keeps u off M_t;
                                              # plus this worker's shard of M_{t+1}, from |m_{t-1}|
    synced = reduce([msg of every worker])    # the mean of the sent values, in rank order; M_{t+1} assembled
    ghat   = sync.apply(synced)               # dense: the mean on M_t, zero off it; M_{t+1} becomes the mask
    ... every worker steps AdamS on ghat (its v = b2*mh^2 + (1-b2)*ghat^2 is rebuilt from this one buffer) ...

Masks: worker ``rank`` owns the ``rank``-th of ``workers`` equal contiguous slices of the flattened
parameters (the layout ZeRO-1 optimizer sharding uses) and picks the top ``(1 - sparsity)`` fraction of
``|m|`` in it; the slices are gathered with step ``t``'s values and used at step ``t + 1``: one step late,
so building and exchanging them overlaps a step of compute. Masks are built from the first moment AdamS
held before step ``t``'s update (``m_{t-1}``), so the mask of step ``t`` comes from ``m_{t-2}``; steps 0
and 1 are dense (no moment exists yet). A slice whose worker did not answer is built locally from the
same first moment (every worker holds the same one), so an island that lost a member still agrees.

Off-mask coordinates stay in the local fp32 residual ``r`` (error feedback, on by default; the paper's
abstract does not say, so it is configurable: ``error_feedback=False`` drops them).

``sparsity = 0`` sends every coordinate: dense AdamS data parallelism, the baseline the sparsity is
measured against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from locomm.compression.scape import _decode_gaps, _encode_gaps

__all__ = ["ScapeMessage", "ScapeSync", "Synced", "decode_indices", "encode_indices", "reduce", "shard_bounds"]


@dataclass
class ScapeMessage:
    """What one worker sends at one step."""

    rank: int
    step: int
    values: torch.Tensor
    """fp32 values of ``u = g + r`` at the current mask's indices (every coordinate while dense)."""
    mask_shard: torch.Tensor | None
    """Sorted flat int64 indices: this worker's slice of the NEXT step's mask (None: no moment yet)."""


@dataclass
class Synced:
    """The one synchronized buffer of a step: every worker applies the same one."""

    step: int
    values: torch.Tensor
    """fp32 mean over the senders of their values, at the current mask's indices."""
    senders: list[int]
    next_mask: torch.Tensor | None
    """Sorted flat indices of the next step's mask, the gathered slices (None: dense next step)."""
    shards_given: list[int]
    """Ranks whose slice arrived; the others are built locally by :meth:`ScapeSync.apply`."""


def shard_bounds(numel: int, workers: int) -> list[tuple[int, int]]:
    """The ``workers`` contiguous slices [lo, hi) of a flat vector of ``numel`` (the last ones 1 shorter)."""
    base, extra = divmod(numel, workers)
    out, lo = [], 0
    for r in range(workers):
        hi = lo + base + (r < extra)
        out.append((lo, hi))
        lo = hi
    return out


def _top(values: torch.Tensor, keep_fraction: float, offset: int) -> torch.Tensor:
    """Sorted flat indices (+ ``offset``) of the top ``keep_fraction`` of ``|values|`` (at least one)."""
    n = values.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    keep = min(n, max(1, math.ceil(keep_fraction * n)))
    idx = values.abs().topk(keep, sorted=False).indices
    return idx.sort().values + offset


def reduce(messages: Sequence[ScapeMessage]) -> Synced:
    """The synchronized buffer from the messages of one step: values summed in rank order, divided once.

    Every message must be of the same step and carry the same number of values (the same mask).
    """
    if not messages:
        raise ValueError("reduce needs at least one message")
    msgs = sorted(messages, key=lambda m: m.rank)
    step, n = msgs[0].step, msgs[0].values.numel()
    for m in msgs:
        if m.step != step or m.values.numel() != n:
            raise ValueError(f"rank {m.rank}: step {m.step} with {m.values.numel()} values, expected {step} and {n}")
    total = msgs[0].values.float().clone()
    for m in msgs[1:]:
        total.add_(m.values.float())
    total.div_(len(msgs))
    shards = [m for m in msgs if m.mask_shard is not None]
    next_mask = torch.cat([m.mask_shard for m in shards]).sort().values if shards else None
    return Synced(step, total, [m.rank for m in msgs], next_mask, [m.rank for m in shards])


class ScapeSync:
    """One worker's side of the sync: its mask, its error-feedback residual and its mask slice.

    Args:
        shapes: parameter name -> shape, in the order the flat vector concatenates them.
        rank: this worker's index in the island, ``0 <= rank < workers``.
        workers: island size (the number of mask slices).
        sparsity: fraction of coordinates not sent, in [0, 1) (0.9 and 0.99 in the paper).
        error_feedback: keep off-mask values in a local residual (default) or drop them.
        residual_decay: the residual is multiplied by this before each step's gradient is added (1: kept whole);
            below 1 it is bounded, ``|r| <= max|g| / (1 - decay)``, where a whole one grew without bound at 99%.
        residual_weight: the owner of a mask slice ranks coordinates by ``|m + residual_weight * r|`` (its own
            residual ``r``, after this step's message), so a coordinate whose unsent gradient piles up comes back
            to the mask; 0 ranks by ``|m|`` alone, where off-mask moments only shrink and masks freeze.
        dense_steps: the first ``dense_steps`` steps send every coordinate (at least the first two: the first
            mask needs a moment).
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        *,
        rank: int,
        workers: int,
        sparsity: float,
        error_feedback: bool = True,
        residual_decay: float = 1.0,
        residual_weight: float = 0.0,
        dense_steps: int = 0,
    ) -> None:
        if not 0 <= sparsity < 1:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        if not 0 <= rank < workers:
            raise ValueError(f"rank {rank} is not in [0, {workers})")
        if not 0 < residual_decay <= 1 or residual_weight < 0 or dense_steps < 0:
            raise ValueError(
                f"need 0 < residual_decay <= 1, residual_weight >= 0 and dense_steps >= 0, got "
                f"{residual_decay}, {residual_weight} and {dense_steps}"
            )
        self.residual_decay, self.residual_weight, self.dense_steps = residual_decay, residual_weight, dense_steps
        self.shapes = {k: tuple(s) for k, s in shapes.items()}
        self.sizes = {k: math.prod(s) for k, s in self.shapes.items()}
        self.numel = sum(self.sizes.values())
        self.rank, self.workers = rank, workers
        self.sparsity, self.error_feedback = float(sparsity), error_feedback
        self.bounds = shard_bounds(self.numel, workers)
        self.step = 0
        self.mask: torch.Tensor | None = None
        """Sorted flat indices of the current step's mask (None: dense)."""
        self.applied: torch.Tensor | None = None
        """The mask the last :meth:`apply` returned values on (None: dense): what :meth:`held` keeps still."""
        self.residual = torch.zeros(self.numel, dtype=torch.float32)

    @classmethod
    def of_spec(cls, shapes: Mapping[str, Sequence[int]], outer: Any, *, rank: int, workers: int) -> ScapeSync:
        """The sync ``outer`` (a spec's ``outer`` section) describes, at its ``scape_*`` options."""
        return cls(
            shapes,
            rank=rank,
            workers=workers,
            sparsity=outer.scape_sparsity,
            error_feedback=outer.scape_error_feedback,
            residual_decay=outer.scape_residual_decay,
            residual_weight=outer.scape_residual_weight,
            dense_steps=outer.scape_dense_steps,
        )

    # -- flat views ------------------------------------------------------------------

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[k].detach().reshape(-1).float().cpu() for k in self.shapes])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, lo = {}, 0
        for k, shape in self.shapes.items():
            out[k] = flat[lo : lo + self.sizes[k]].reshape(shape)
            lo += self.sizes[k]
        return out

    def slice_size(self, rank: int) -> int:
        """How many indices slice ``rank`` of a mask holds (what :meth:`mask_slice` picks)."""
        lo, hi = self.bounds[rank]
        n = hi - lo
        return n if self.sparsity == 0 else (min(n, max(1, math.ceil((1.0 - self.sparsity) * n))) if n else 0)

    def mask_slice(
        self, first_moment: Mapping[str, torch.Tensor], rank: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Slice ``rank`` of the next mask: the top (1 - sparsity) of |m| within that worker's slice (of
        ``|m + residual_weight * residual|`` when the owner passes its residual)."""
        lo, hi = self.bounds[rank]
        if self.sparsity == 0:
            return torch.arange(lo, hi, dtype=torch.long)
        score = self.flatten(first_moment)[lo:hi]
        if residual is not None and self.residual_weight > 0:
            score = score.add(residual[lo:hi], alpha=self.residual_weight)
        return _top(score, 1.0 - self.sparsity, lo)

    def held(self) -> dict[str, torch.Tensor] | None:
        """Per parameter, where the last applied step had values (bool; None when it was dense): the coordinates
        an optimizer that holds the rest may update (``AdamS.hold_off``)."""
        if self.applied is None:
            return None
        on = torch.zeros(self.numel, dtype=torch.bool)
        on[self.applied] = True
        return self.unflatten(on)

    # -- one step --------------------------------------------------------------------

    def plan(self, grads: Mapping[str, torch.Tensor], first_moment: Mapping[str, torch.Tensor] | None) -> ScapeMessage:
        """This step's message; ``first_moment``: the optimizer's m before this step's update (None if none)."""
        g = self.flatten(grads)
        if self.error_feedback:
            if self.residual_decay < 1:
                self.residual.mul_(self.residual_decay)
            u = self.residual.add_(g)  # u = g + r, in place: r becomes what is not sent
        else:
            u = g
        if self.mask is None:
            values = u.clone()
            if self.error_feedback:
                u.zero_()
        else:
            values = u[self.mask]
            if self.error_feedback:
                u[self.mask] = 0.0
        shard = None
        if first_moment is not None and self._masked_next():  # sparsity 0: dense, no mask at all
            shard = self.mask_slice(first_moment, self.rank, self.residual if self.error_feedback else None)
        return ScapeMessage(self.rank, self.step, values, shard)

    def _masked_next(self) -> bool:
        """Whether the step after this one is sparse (past the dense warm-up)."""
        return self.sparsity > 0 and self.step + 1 >= self.dense_steps

    def apply(self, synced: Synced, first_moment: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The dense gradient every worker steps on, and the next mask (missing slices built locally)."""
        if synced.step != self.step:
            raise ValueError(f"synced buffer of step {synced.step}, this worker is at step {self.step}")
        want = self.numel if self.mask is None else self.mask.numel()
        if synced.values.numel() != want:
            raise ValueError(f"synced buffer has {synced.values.numel()} values, the mask {want}")
        if self.mask is None:
            ghat = synced.values.float().clone()
        else:
            ghat = torch.zeros(self.numel, dtype=torch.float32)
            ghat[self.mask] = synced.values.float()
        self.applied = self.mask
        if self._masked_next() and (synced.next_mask is not None or first_moment is not None):
            self.mask = self._assemble(synced, first_moment)
        self.step += 1
        return self.unflatten(ghat)

    def _assemble(self, synced: Synced, first_moment: Mapping[str, torch.Tensor] | None) -> torch.Tensor | None:
        given = set(synced.shards_given)
        missing = [r for r in range(self.workers) if r not in given]
        if not missing:
            return synced.next_mask
        if first_moment is None:  # no moment here (none anywhere: members are identical): the next step is dense
            return None
        parts = [synced.next_mask] if synced.next_mask is not None else []
        parts += [self.mask_slice(first_moment, r) for r in missing]
        return torch.cat(parts).sort().values

    def bytes_per_step(self, values_dtype_bytes: int = 4) -> dict[str, float]:
        """What one message moves at the current mask: values, and this worker's mask slice as gaps."""
        n = self.numel if self.mask is None else self.mask.numel()
        lo, hi = self.bounds[self.rank]
        own = self.mask[(self.mask >= lo) & (self.mask < hi)] if self.mask is not None else None
        mask_b = len(encode_indices(own - lo)) if own is not None else 0
        return {"values": float(n * values_dtype_bytes), "mask": float(mask_b), "dense": float(self.numel * 4)}


def encode_indices(idx: torch.Tensor) -> bytes:
    """Sorted non-negative flat indices as LEB128 gaps (the ``scape`` codec's index format)."""
    return _encode_gaps(idx.numpy().astype(np.int64))


def decode_indices(data: bytes | bytearray | memoryview, count: int, limit: int) -> torch.Tensor:
    """Inverse of :func:`encode_indices`; every index is checked to lie below ``limit`` (CodecError if not)."""
    return torch.from_numpy(_decode_gaps(np.frombuffer(data, dtype=np.uint8), count, limit).copy())

"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): DiLoCo's outer loop on sparse 2-bit updates.

    D_r    = phi - theta_r                      # this worker's pseudo-gradient
    e_r    = beta*e_r + D_r                     # error feedback   } the topk2bit codec,
    Dhat_r = Q2(TopK_per_chunk(e_r))            # chunked top-k    } which keeps e_r
    e_r    = e_r - Dhat_r                       #                  }
    D      = (1/R) sum_r Dhat_r                # the paper's mean over all R workers of the exchange
                                                # (an index worker r did not send is 0 in Dhat_r)
    phi    = phi - alpha*D ;  theta_r = phi     # no outer momentum

R counts this worker and whoever answered. ``outer.sparseloco_aggregation = "senders"``
takes the public production code's rule instead (Templar's ``scatter_reduce(mean,
include_self=False)``): each index averaged over the workers that sent it. With a fixed
alpha that update grows with R where the workers' top-k sets differ (an index one worker
sent is applied at full size, not 1/R of it). ``outer.sparseloco_clip = "median"`` scales
each sender's update to a tensor down to the median norm of the round's senders, as that
code clips before aggregating (per tensor here). Its 64x64 tiles and +-6 sigma value
bins are not taken: the codec keeps 1-D chunks of 64 and two fitted levels.

The payload is the codec's bytes, so the bytes on the wire are exactly what the
codec produced; the codec is :func:`~locomm.compression.choice.codec_choice`'s.
Equations from secondary summaries (docs/algorithms.md §4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from locomm.compression.base import TensorRole
from locomm.compression.choice import codec_choice
from locomm.config import CompressionConfig, OuterConfig
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload


class SparseLoCo(OuterAlgorithm):
    name = "sparseloco"
    payload_roles = {"sparse": TensorRole.OUTER_GRADIENT.value}

    def __init__(
        self,
        cfg: OuterConfig,
        params: Params,
        me: int,
        codec_factory: Callable[[], Any] | None = None,
        codec: str | None = None,
    ) -> None:
        super().__init__(cfg, params, me)
        # The one codec decision: topk2bit from spec.outer (compression.outer_gradient does not apply to a
        # payload the algorithm encodes itself, so the default compression section stands in for the run's).
        # ``codec`` names another sparse codec with the same density and decay (``topktiles``: the simulator's
        # variant, measured before the run spec offers it).
        choice = codec_choice(TensorRole.OUTER_GRADIENT, CompressionConfig(), outer=cfg)
        if codec is not None:
            choice = dataclasses.replace(choice, stack=codec)
        self.payload_encoded = {"sparse": choice.stack}  # receivers decode with a stateless instance of it
        make = codec_factory or choice.build
        self.codecs = {k: make() for k in self.phi}  # one error-feedback buffer per parameter

    def plan(self, round_idx: int, members: Sequence[int], params: Params) -> Exchange:
        payload: Payload = {
            f"sparse/{k}": self.codecs[k].encode(self.phi[k] - p.detach().float()) for k, p in params.items()
        }
        return Exchange(peers=[m for m in members if m != self.me], payload=payload, collective=True)

    def apply(self, round_idx: int, params: Params, received: Mapping[int, Payload]) -> None:
        senders = self.cfg.sparseloco_aggregation == "senders"
        for k, phi in self.phi.items():
            total = torch.zeros_like(phi)
            count = torch.zeros_like(phi) if senders else None
            for d in self._clipped([self._decoded(k, pl) for pl in received.values()]):
                total.add_(d)
                if count is not None:
                    count.add_((d != 0).float())
            mean = total.div_(count.clamp_(min=1)) if count is not None else total.div_(len(received))
            phi.sub_(mean, alpha=self.cfg.sparse_lr)
        self._set_params(params, self.phi)

    def _decoded(self, k: str, pl: Payload) -> torch.Tensor:
        phi = self.phi[k]
        v = pl[f"sparse/{k}"]  # the codec's bytes (own payload), or a tensor the transport decoded
        if isinstance(v, (bytes, bytearray, memoryview)):  # bounded by phi: a larger claim allocates nothing
            v = self.codecs[k].decode(v, max_numel=phi.numel())
        return v.float().reshape(phi.shape)

    def _clipped(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.cfg.sparseloco_clip != "median" or len(updates) < 2:
            return updates
        norms = torch.stack([d.norm() for d in updates])
        cap = norms.median()  # the lower middle for an even count: a lone large sender cannot set it
        return [d * torch.clamp(cap / n, max=1.0) if n > 0 else d for d, n in zip(updates, norms)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """phi and each parameter's error-feedback residual (zeros before the first round)."""
        ef = {}
        for k, phi in self.phi.items():
            e = self.codecs[k].error
            ef[f"ef/{k}"] = e.view(phi.shape) if e is not None else torch.zeros_like(phi)
        return {**super().state_dict(), **ef}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for k, phi in self.phi.items():  # materialize the buffers so the base class copies into them
            if self.codecs[k].error is None:
                self.codecs[k].error = torch.zeros(phi.numel(), dtype=torch.float32)
        super().load_state_dict(tensors)

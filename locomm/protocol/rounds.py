"""The round schedule both transports follow: plan, the copy that was sent, and when the outer update lands.

Sans-IO: tensors and an outer algorithm in, tensors out; the transport moves the payloads.
One round of one worker (``peer/dataparallel/node.py``, ``peer/pipeline/stage.py``, ``sim/simulator.py``,
``sim/pipeline.py``):

    planned = plan(algo, r, members, params)     # theta_sent: a copy of the weights, and the payload
    ... the transport exchanges planned.exchange.payload with planned.exchange.peers ...
    apply_late(algo, r, params, planned.sent, received)

Overlapped (the default): the exchange runs while the next round's inner steps compute,
and is applied one round late, keeping the local progress made meanwhile:

    theta <- phi_new + (theta_now - theta_sent),  phi_new = the outer update of theta_sent

computed as ``theta_now + (outer(theta_sent) - theta_sent)``, in that order (both transports
must round the same way). It is applied ``apply_step(H, apply_delay_steps)`` inner steps
into the next round (H: at its end, just before that round's plan), so the numerics do
not depend on how fast the network was as long as an exchange takes no longer than that.
Blocking (``--no-overlap``): the transport waits for the exchange and applies it at once,
with the same arithmetic (no local progress was made).

A partner's payload of round r is taken while the receiver has opened round r - 1, r
or r + 1 (``RECEIVE_WINDOW``).

Screening: ``Rounds.settle`` passes what arrived through the run spec's poisoning defence
(``protocol/defence.py``) before the outer rule takes it; ``Rounds.rejected`` (a fault against each
sender named), ``Rounds.clipped`` and ``Rounds.fallback`` tell the transport what it did that settle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from locomm.config import DefenceConfig, RunSpec
from locomm.protocol.base import Exchange, OuterAlgorithm, Params, Payload
from locomm.protocol.defence import Defence, Screened

RECEIVE_WINDOW = 1
"""A receiver in round c takes payloads of rounds c - 1 .. c + 1."""


def snapshot(params: Params) -> dict[str, torch.Tensor]:
    """The copy of the weights a round sends (theta_sent), detached from the live model."""
    return {k: p.detach().clone() for k, p in params.items()}


@dataclass
class Planned:
    """One round's plan: what goes out, and the weights it was computed from."""

    round_idx: int
    exchange: Exchange
    sent: dict[str, torch.Tensor]
    """theta_sent: the weights when the round was planned."""

    def received(self, me: object, got: Mapping[object, Payload]) -> dict[object, Payload]:
        """What the outer rule takes: our own payload (it never crosses the wire) and whoever answered."""
        return {me: self.exchange.payload, **got}


def plan(algo: OuterAlgorithm, round_idx: int, members: Sequence, params: Params) -> Planned:
    """Snapshot the weights, then let the algorithm plan the round from them."""
    sent = snapshot(params)
    return Planned(round_idx, algo.plan(round_idx, members, params), sent)


def apply_late(
    algo: OuterAlgorithm,
    round_idx: int,
    params: Params,
    sent: Mapping[str, torch.Tensor],
    received: Mapping,
    defence: Defence | None = None,
) -> Screened | None:
    """The outer update of the weights that were sent, with the local progress made since kept on top:
    theta <- theta_now + (outer(theta_sent) - theta_sent), in place.

    With ``defence``, ``received`` is screened first and what the screening did is returned."""
    screened = defence.screen(received, sent) if defence is not None else None
    if screened is not None:
        received = screened.received
    target = {k: v.clone() for k, v in sent.items()}
    algo.apply(round_idx, target, received)
    _keep_progress(params, sent, target)
    return screened


def follow_late(
    algo: OuterAlgorithm, params: Params, sent: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> None:
    """``apply_late`` for a peer that did not run the outer rule itself (an island follower): the outer state
    ``state`` that another peer's ``apply_late`` reached is loaded, and its outer weights take the place of
    ``outer(theta_sent)``: theta <- theta_now + (phi - theta_sent), in place."""
    algo.load_state_dict(state)
    target = {k: algo.phi[k].to(device=v.device, dtype=v.dtype) for k, v in sent.items()}
    _keep_progress(params, sent, target)


def _keep_progress(params: Params, sent: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in params.items():
            p.add_(target[k] - sent[k])


def apply_blocking(
    algo: OuterAlgorithm, planned: Planned, params: Params, received: Mapping, defence: Defence | None = None
) -> Screened | None:
    """The blocking variant: the exchange was waited for before any further step (``params`` still hold
    ``planned.sent``); the same arithmetic as ``apply_late``, so both schedules round alike."""
    return apply_late(algo, planned.round_idx, params, planned.sent, received, defence)


def apply_step(inner_steps: int, apply_delay_steps: int = 0) -> int:
    """Inner steps into a round at which the previous round's exchange is applied (``inner_steps``: at the
    round's end, before its plan)."""
    return apply_delay_steps if 0 < apply_delay_steps < inner_steps else inner_steps


def in_window(round_idx: int, current_round: int) -> bool:
    """Whether a receiver that has opened ``current_round`` takes a payload of ``round_idx``."""
    return abs(round_idx - current_round) <= RECEIVE_WINDOW


class Rounds:
    """One worker's round schedule: at most one exchange pending, applied one round late (or at once).

    The transport calls ``due(i)`` before inner step i of a round and ``settle`` when it is; at the end
    of the round's steps ``settle`` again (a no-op when already applied), then ``start`` the next
    round; in blocking mode the transport exchanges and settles right after ``start``. Each settle resets
    ``rejected``, ``clipped`` and ``fallback``; one that applied a round fills them with its screening.

    ``defence``: the run spec's ``[defence]`` (default: ``DefenceConfig()``, on).
    """

    def __init__(
        self,
        algo: OuterAlgorithm,
        inner_steps: int,
        *,
        overlap: bool = True,
        apply_delay_steps: int = 0,
        defence: DefenceConfig | None = None,
    ) -> None:
        self.algo = algo
        self.overlap = overlap
        self.at = apply_step(inner_steps, apply_delay_steps if overlap else 0)
        self.pending: Planned | None = None
        self.received: Mapping | None = None
        self.defence = Defence(defence if defence is not None else DefenceConfig(), algo)
        self.outcome = Screened(received={})
        """The last applied round's screening (empty before the first)."""

    @classmethod
    def of_spec(cls, algo: OuterAlgorithm, spec: RunSpec, *, overlap: bool = True, pipeline: bool = False) -> Rounds:
        """The schedule a run spec gives, the same in the daemon and the simulator: the spec's defence, and its
        ``apply_delay_steps`` (a pipeline stage applies at its next sync instead, by the data clock)."""
        delay = 0 if pipeline else spec.outer.apply_delay_steps
        return cls(algo, spec.outer.inner_steps, overlap=overlap, apply_delay_steps=delay, defence=spec.defence)

    @property
    def rejected(self) -> list[tuple[object, str]]:
        """(sender, reason) of each update the last applied round dropped: record a fault against each."""
        return self.outcome.rejected

    @property
    def clipped(self) -> list[tuple[object, float]]:
        """(sender, scale) of each update the last applied round scaled down to its bound."""
        return self.outcome.clipped

    @property
    def fallback(self) -> str | None:
        """DiLoCo: why the last applied round took the own step instead of the group's mean (None: it did not)."""
        return self.outcome.fallback

    def start(self, round_idx: int, members: Sequence, params: Params) -> Planned:
        """Plan round ``round_idx`` (the previous one must be settled first)."""
        if self.pending is not None:
            raise RuntimeError(f"round {self.pending.round_idx} is still pending; settle it first")
        self.pending = plan(self.algo, round_idx, members, params)
        self.received = None
        return self.pending

    def drop(self) -> None:
        """Forget the pending round without applying it (its exchange was cancelled: a peer stopping)."""
        self.pending, self.received = None, None

    def arrived(self, received: Mapping) -> None:
        """The exchange is over: this is what the outer rule takes (own payload included)."""
        self.received = received

    def due(self, step_in_round: int) -> bool:
        """Whether the pending exchange is applied before inner step ``step_in_round`` of this round."""
        return self.pending is not None and step_in_round == self.at

    def settle(self, params: Params, received: Mapping | None = None) -> int | None:
        """Screen and apply the pending exchange (``received``, or what ``arrived`` recorded); returns its round."""
        self.outcome = Screened(received={})
        if self.pending is None:
            return None
        planned, self.pending = self.pending, None
        got = received if received is not None else self.received
        self.received = None
        if got is None:
            raise RuntimeError(f"round {planned.round_idx}: settled before its exchange arrived")
        outcome = apply_late(self.algo, planned.round_idx, params, planned.sent, got, self.defence)
        if outcome is not None:
            self.outcome = outcome
        return planned.round_idx

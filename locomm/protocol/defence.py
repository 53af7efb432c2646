"""Poisoning defence: screen the outer updates a worker received before its outer rule takes them.

Sans-IO, one rule per algorithm, configured by the run spec's ``[defence]`` (config/defence.py).
:class:`locomm.protocol.rounds.Rounds` screens every settle through :meth:`Defence.screen`, so the
simulator and the daemon run the same rule; ``Rounds.rejected`` / ``Rounds.clipped`` say what it did.

With ``ref`` the reference size and ``s`` a sender's size (``factor`` and ``reject_factor`` from the spec)::

    ref = max(own size, RunningMedian of accepted sizes)   # the own size alone until `warmup` accepted
    s <= factor*ref                        -> accepted (s joins the median)
    mode=reject, or s > reject_factor*ref  -> rejected: a fault against the sender, the round goes on
    otherwise (mode=clip)                  -> clipped down to ref (as Templar clips to the median norm)
    any non-finite value                   -> rejected

- NoLoCo / GASLoC: a sender's size is the distance of the point it sent (NoLoCo's theta, or phi + delta;
  GASLoC's y) from the receiver's phi; the own size is the receiver's own point's distance. Clipping
  scales the sender's deviation from the receiver's phi: ``x <- phi + (ref/s)*(x - phi)``.
- SparseLoCo: per tensor, a sender's value norm and its largest value (its top quantization level) against
  the receiver's own and their running medians; each tensor over its bound is scaled down to the reference.
  This is Templar's production rule (one-covenant/templar, ``neurons/validator.py``
  ``compute_peer_val_norms``: the per-parameter median over peers of each peer's value norm, to which
  every peer's values are clipped), here applied only beyond ``factor`` so that clean rounds are untouched.
- DiLoCo: hivemind's averager returns only the group's mean (``GROUP_MEAN``), so nothing can be
  attributed: a non-finite mean, or one whose norm exceeds ``diloco_factor`` x the own pseudo-gradient's,
  falls back to the own step (``Screened.fallback``). It cannot stop an attacker that stays under the
  bound, nor tell who sent a bad update.

Not done: the loss-delta check (Templar's idea: the partner's point evaluated on a few held-out batches);
it needs the model, which this module does not have. A sign-flipped NoLoCo/GASLoC update has the norm of
an honest one, so the norm rules above do not see it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from locomm.config import DefenceConfig
from locomm.protocol.base import OuterAlgorithm, Payload

GROUP_MEAN = "group-mean"
"""The key of the one payload DiLoCo's averager hands back: the group's mean, with no sender to blame."""


class RunningMedian:
    """The median of the last ``window`` values given to :meth:`update` (non-finite values are ignored).

    Used for accepted update sizes here and for pipeline activation norms; the caller decides what counts
    as accepted, so an attacker's values never move the median it is judged against.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.values: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self.values)

    def update(self, value: float) -> None:
        """Add one value (the oldest drops out once ``window`` are held)."""
        if math.isfinite(value):
            self.values.append(float(value))

    def median(self) -> float | None:
        """The median of the values held, or None when there are none."""
        return statistics.median(self.values) if self.values else None

    def bound(self, factor: float) -> float | None:
        """``factor`` x the median, or None when there is no median yet."""
        m = self.median()
        return None if m is None else factor * m


@dataclass
class Screened:
    """What the screening of one round did."""

    received: dict
    """What the outer rule takes: the accepted updates, clipped ones scaled down (own payload included)."""
    senders: list = field(default_factory=list)
    """The other workers whose updates were screened (the own payload and ``GROUP_MEAN`` excluded)."""
    rejected: list[tuple[object, str]] = field(default_factory=list)
    """(sender, reason) of each dropped update: a fault against the sender."""
    clipped: list[tuple[object, float]] = field(default_factory=list)
    """(sender, scale) of each update scaled down (scale < 1: the smallest applied to any of its tensors)."""
    fallback: str | None = None
    """DiLoCo: why the own pseudo-gradient replaced the group's mean (None: it did not)."""


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class Defence:
    """One worker's screening of received outer updates, with its running medians.

    Args:
        cfg: The run spec's ``[defence]`` section.
        algo: The worker's outer algorithm (its ``phi`` is the reference point; its codecs decode SparseLoCo).
    """

    def __init__(self, cfg: DefenceConfig, algo: OuterAlgorithm) -> None:
        self.cfg = cfg
        self.algo = algo
        self.distances = RunningMedian(cfg.window)
        self.norms: dict[str, RunningMedian] = {}
        self.levels: dict[str, RunningMedian] = {}

    def _reference(self, own: float, median: RunningMedian) -> float:
        m = median.median()
        return max(own, m) if m is not None and len(median) >= self.cfg.warmup else own

    def _verdict(self, size: float, ref: float) -> str:
        """accept, clip or reject, for one size against its reference."""
        if ref <= 0 or size <= self.cfg.factor * ref:
            return "accept"  # no reference (no own progress, no median yet): nothing to judge against
        if self.cfg.mode == "reject" or size > self.cfg.reject_factor * ref:
            return "reject"
        return "clip"

    def screen(self, received: Mapping, sent: Mapping[str, torch.Tensor]) -> Screened:
        """Screen one round's ``received`` (own payload included, as the outer rule takes it).

        ``sent`` is theta_sent, the weights the round was planned from (DiLoCo's own pseudo-gradient when
        the averager's mean is all that came back)."""
        me = self.algo.me
        out = Screened(received=dict(received), senders=[j for j in received if j != me and j != GROUP_MEAN])
        if not self.cfg.enabled:
            return out
        name = self.algo.name
        if name == "diloco":
            self._screen_mean(out, sent)
        elif name == "sparseloco":
            self._screen_sparse(out)
        elif name in ("noloco", "gasloc"):
            self._screen_points(out, sent)
        return out

    # -- NoLoCo, GASLoC ------------------------------------------------------------

    def _point(self, payload: Payload) -> dict[str, torch.Tensor]:
        """The point a payload carries (NoLoCo's theta or phi + delta, GASLoC's y), per parameter."""
        algo = self.algo
        if algo.name == "gasloc":
            return {k: payload[f"y/{k}"].float() for k in algo.phi}
        if "theta" in algo.payload_roles:
            return {k: payload[f"theta/{k}"].float() for k in algo.phi}
        return {k: payload[f"phi/{k}"].float() + payload[f"delta/{k}"].float() for k in algo.phi}

    def _own_point(self, received: Mapping, sent: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.algo.me in received:
            return self._point(received[self.algo.me])
        phi = self.algo.phi
        if self.algo.name == "gasloc":
            return {k: phi[k] + self.algo.cfg.lr * (sent[k].float() - phi[k]) for k in phi}
        return {k: sent[k].float() for k in phi}

    def _distance(self, point: Mapping[str, torch.Tensor]) -> float:
        phi = self.algo.phi
        return math.sqrt(sum(float((point[k] - phi[k]).square().sum()) for k in phi))

    def _screen_points(self, out: Screened, sent: Mapping[str, torch.Tensor]) -> None:
        ref = self._reference(self._distance(self._own_point(out.received, sent)), self.distances)
        accepted = []
        for j in out.senders:
            point = self._point(out.received[j])
            if not _finite(point.values()):
                self._reject(out, j, "non-finite update")
                continue
            d = self._distance(point)
            verdict = self._verdict(d, ref)
            if verdict == "accept":
                accepted.append(d)
            elif verdict == "reject":
                self._reject(out, j, f"distance {d:.3g} is {d / ref:.1f}x the reference {ref:.3g}")
            else:
                out.received[j] = self._scaled(out.received[j], ref / d)
                out.clipped.append((j, ref / d))
        for d in accepted:  # after every verdict: the order of senders does not matter
            self.distances.update(d)

    def _scaled(self, payload: Payload, s: float) -> Payload:
        """The payload with its deviation from the receiver's phi scaled by ``s``."""
        phi, new = self.algo.phi, dict(payload)
        for k in phi:
            if self.algo.name == "gasloc":
                new[f"y/{k}"] = phi[k] + s * (payload[f"y/{k}"].float() - phi[k])
            elif "theta" in self.algo.payload_roles:
                new[f"theta/{k}"] = phi[k] + s * (payload[f"theta/{k}"].float() - phi[k])
            else:
                new[f"phi/{k}"] = phi[k] + s * (payload[f"phi/{k}"].float() - phi[k])
                new[f"delta/{k}"] = s * payload[f"delta/{k}"].float()
        return new

    @staticmethod
    def _reject(out: Screened, sender: object, reason: str) -> None:
        out.received.pop(sender, None)
        out.rejected.append((sender, reason))

    # -- SparseLoCo ----------------------------------------------------------------

    def _values(self, payload: Payload, k: str) -> torch.Tensor:
        v = payload[f"sparse/{k}"]
        d = self.algo.codecs[k].decode(v) if isinstance(v, (bytes, bytearray, memoryview)) else v  # type: ignore[attr-defined]
        return d.float().reshape(self.algo.phi[k].shape)

    def _screen_sparse(self, out: Screened) -> None:
        me, cfg = self.algo.me, self.cfg
        own = {k: self._values(out.received[me], k) for k in self.algo.phi} if me in out.received else {}
        refs = {}
        for k in self.algo.phi:
            norms = self.norms.setdefault(k, RunningMedian(cfg.window))
            levels = self.levels.setdefault(k, RunningMedian(cfg.window))
            o = own.get(k)
            refs[k] = (
                self._reference(float(o.norm()) if o is not None else 0.0, norms),
                self._reference(float(o.abs().max()) if o is not None and o.numel() else 0.0, levels),
            )
        accepted: list[tuple[str, float, float]] = []
        for j in out.senders:
            values = {k: self._values(out.received[j], k) for k in self.algo.phi}
            if not _finite(values.values()):
                self._reject(out, j, "non-finite update")
                continue
            scales, mine, worst = {}, [], ""
            for k, v in values.items():
                n, lv = float(v.norm()), float(v.abs().max()) if v.numel() else 0.0
                (rn, rl), verdicts = refs[k], (self._verdict(n, refs[k][0]), self._verdict(lv, refs[k][1]))
                if "reject" in verdicts:
                    worst = f"{k}: norm {n:.3g} (reference {rn:.3g}), top level {lv:.3g} (reference {rl:.3g})"
                    break
                if "clip" in verdicts:
                    scales[k] = min(rn / n if n > cfg.factor * rn else 1.0, rl / lv if lv > cfg.factor * rl else 1.0)
                else:
                    mine.append((k, n, lv))
            if worst:
                self._reject(out, j, worst)
                continue
            if scales:
                pl = dict(out.received[j])
                for k, s in scales.items():
                    pl[f"sparse/{k}"] = values[k] * s
                out.received[j] = pl
                out.clipped.append((j, min(scales.values())))
            accepted.extend(mine)
        for k, n, lv in accepted:
            self.norms[k].update(n)
            self.levels[k].update(lv)

    # -- DiLoCo --------------------------------------------------------------------

    def _screen_mean(self, out: Screened, sent: Mapping[str, torch.Tensor]) -> None:
        me, phi = self.algo.me, self.algo.phi
        own = out.received.get(me) or {f"delta/{k}": phi[k] - sent[k].float() for k in phi}
        got = list(out.received.values())
        sq, own_sq, finite = 0.0, 0.0, True
        for k in phi:
            key = f"delta/{k}"
            mean = sum(p[key].float() for p in got) / len(got)
            finite = finite and bool(torch.isfinite(mean).all())
            sq += float(mean.square().sum())
            own_sq += float(own[key].float().square().sum())
        norm, own_norm = math.sqrt(sq) if finite else math.inf, math.sqrt(own_sq)
        if not finite:
            out.fallback = "non-finite mean"
        elif own_norm > 0 and norm > self.cfg.diloco_factor * own_norm:
            out.fallback = f"mean's norm {norm:.3g} is {norm / own_norm:.1f}x the own pseudo-gradient's"
        if out.fallback is not None:
            out.received = {me: own}


class BoundaryNorm:
    """The pipeline's poisoning bound: a micro-batch's activation (or gradient) whose RMS exceeds
    ``defence.reject_factor`` x the running median of the accepted ones is refused (a fault against its
    sender; the micro-batch is re-routed or lost, the step goes on). No bound until ``defence.window`` values
    are held: early training moves these sizes fast, and a median of a few is no reference. One far below the
    median (under 1/reject_factor of it) is taken but does not join the median: a sender of tiny tensors must
    not pull the bound down until honest senders fail it.

    Why ``reject_factor`` (30) and not ``factor`` (3): at 3 x an honest 2 x 2 nano pipeline faulted its own
    stage-0 replicas within 32 steps (6 faults, 70 micro-batches lost; 0 of both at 30 x): boundary sizes move
    more between micro-batches than outer updates between rounds. A scaled (x100) boundary is caught; one
    scaled by less than 30 is not."""

    def __init__(self, cfg: DefenceConfig) -> None:
        self.cfg = cfg
        self.median = RunningMedian(cfg.window)
        self.refused = 0

    def check(self, t: torch.Tensor | None) -> str | None:
        """None when ``t`` is accepted (its RMS then joins the median), else why it is refused."""
        if t is None or not self.cfg.enabled:
            return None
        rms = float(t.detach().float().pow(2).mean().sqrt())
        bound = self.median.bound(self.cfg.reject_factor) if len(self.median) >= self.cfg.window else None
        if bound is not None and rms > bound:
            self.refused += 1
            return f"RMS {rms:.3g} over {self.cfg.reject_factor:g} x the median {self.median.median():.3g}"
        if bound is None or rms * self.cfg.reject_factor**2 >= bound:  # i.e. rms >= median / reject_factor
            self.median.update(rms)
        return None

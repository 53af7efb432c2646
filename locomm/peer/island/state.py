"""An island member's state transfer (``island.state``, ``island.outer``), through a narrow trainer interface.

An island touches its data-parallel driver only through :class:`Trainee`: the weights, the inner optimizer's
AdamS moments, the outer algorithm and its pending round, and where in the schedule it is. What a follower
downloads from its representative (``state_of`` there, ``load_state`` here) and how it lands an outer round
(``apply_outer``, ``protocol/rounds.follow_late``) are written against it, never against the node.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from locomm.config import RunSpec
from locomm.peer.host import Host
from locomm.peer.options import NodeOptions
from locomm.protocol.base import OuterAlgorithm
from locomm.protocol.rounds import Rounds, follow_late
from locomm.protocol.scape import ScapeSync

Layout = tuple[dict[str, tuple[int, ...]], frozenset[str]]


class Inner(Protocol):
    """The inner trainer as an island sees it."""

    step: int
    optimizer: torch.optim.Optimizer

    def compute_gradients(self) -> float: ...

    def apply_gradients(self) -> None: ...


class Trainee(Protocol):
    """What an island member reads and writes of the driver it trains in (the data-parallel node)."""

    spec: RunSpec
    opts: NodeOptions
    host: Host
    algo: OuterAlgorithm
    rounds: Rounds
    round: int
    step_in_round: int

    @property
    def trainer(self) -> Inner: ...

    def params(self) -> dict[str, torch.Tensor]: ...


def state_header(t: Trainee) -> Layout:
    """The layout an ``island.state`` answer may carry: weights, AdamS moments, outer state, theta_sent."""
    params = {k: tuple(p.shape) for k, p in t.params().items()}
    want = {f"model/{k}": s for k, s in params.items()}
    optional = {f"adam/{k}": s for k, s in params.items()} | {f"sent/{k}": s for k, s in params.items()}
    want |= optional | {f"outer/{k}": tuple(v.shape) for k, v in t.algo.state_dict().items()}
    return want, frozenset(optional)


def apply_outer(t: Trainee, sent: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """A follower lands a round: the settled outer state, then theta += phi - theta_sent (``follow_late``)."""
    follow_late(t.algo, t.params(), sent, state)


def state_of(
    t: Trainee, sync: ScapeSync, sent: dict[int, dict[str, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What ``island.state`` sends (on the compute thread: a step boundary). ``sent``: theta_sent of the rounds
    this member planned and has not landed yet."""
    params = t.params()
    opt = t.trainer.optimizer
    tensors = {f"model/{k}": p.detach() for k, p in params.items()}
    adam_step = 0.0
    for k, p in params.items():
        st = opt.state.get(p)
        if st:
            tensors[f"adam/{k}"] = st["exp_avg"]
            adam_step = float(st["step"])
    tensors |= {f"outer/{k}": v for k, v in t.algo.state_dict().items()}
    pending = t.rounds.pending
    sent_round = pending.round_idx if pending is not None else (max(sent) if sent else -1)
    theta_sent = pending.sent if pending is not None else sent.get(sent_round)
    if theta_sent is not None:
        tensors |= {f"sent/{k}": v for k, v in theta_sent.items()}
    mask = sync.mask
    fields = {
        "trainer_step": t.trainer.step,
        "adam_step": adam_step,
        "sync_step": sync.step,
        "round": t.round,
        "step_in_round": t.step_in_round,
        "sent_round": sent_round if theta_sent is not None else -1,
        "nmask": -1 if mask is None else mask.numel(),
    }
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, fields | {"mask": mask}


def load_state(
    t: Trainee, sync: ScapeSync, tensors: dict[str, torch.Tensor], fields: dict[str, Any], mask: torch.Tensor | None
) -> dict[int, dict[str, torch.Tensor]]:
    """Take a representative's state (the compute thread); returns the theta_sent it carried, by round."""
    params = t.params()
    opt = t.trainer.optimizer
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[f"model/{k}"])
            if f"adam/{k}" in tensors:
                st = opt.state[p]
                st["exp_avg"] = tensors[f"adam/{k}"].to(p.device).clone()
                st["step"] = torch.tensor(float(fields["adam_step"]))
            else:
                opt.state.pop(p, None)
    t.algo.load_state_dict({k[len("outer/") :]: v for k, v in tensors.items() if k.startswith("outer/")})
    sent = {}
    if fields["sent_round"] >= 0:
        sent[fields["sent_round"]] = {k: tensors[f"sent/{k}"].to(p.device, p.dtype) for k, p in params.items()}
    t.trainer.step = fields["trainer_step"]
    t.round, t.step_in_round = fields["round"], fields["step_in_round"]
    sync.step, sync.mask = fields["sync_step"], mask
    sync.residual.zero_()
    return sent

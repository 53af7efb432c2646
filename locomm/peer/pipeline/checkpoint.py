"""A pipeline stage replica's checkpoint: its stage's weights, inner optimizer, outer state and clocks.

Notable:
- The data-parallel node's file and format (``locomm/checkpoint.py``: atomic, temp files of killed
  writes swept at start, an unreadable file set aside with an event), with the stage, the stage count
  and the data clock in its metadata.
- Only a replica of the same run spec and the same stage resumes from it. ``--stage auto`` takes the
  checkpoint's stage; ``--stage K`` with a checkpoint of another stage is an error (exit 2) rather than
  a fresh start with a warning, because that fresh start would overwrite the other stage's checkpoint at
  its first ``--checkpoint-every``: the user's work, lost to a typo.
- Written from CPU copies taken in the compute thread, in a writer thread: training goes on while the
  file is written. One write at a time: a write still running when the next is due skips that one; the
  final one (clean shutdown) waits for it.
- Ours or the siblings', which is newer: a resumed replica syncs from its stage's siblings only when
  their data clock is a whole round past ours (:meth:`StageCheckpoints.should_sync`); otherwise
  (the whole swarm restarted, or we were gone for less than a round) it keeps its own state and the next
  replica sync averages it in, as for any replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from locomm.checkpoint import (
    CHECKPOINT_NAME,
    SPEC_KEY,
    Checkpoint,
    CheckpointError,
    load_model_tensors,
    model_tensors,
    open_checkpoint,
    save_checkpoint,
)
from locomm.config import RunSpec
from locomm.protocol.membership import Heartbeat, robust_top
from locomm.train.stage import StageWorker

log = logging.getLogger(__name__)


class _Outer(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None: ...


class _Sampler(Protocol):
    def state(self) -> dict: ...
    def set_state(self, state: dict) -> None: ...


class _Events(Protocol):
    def write(self, event: str, **fields: Any) -> None: ...


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def capture_stage(
    worker: StageWorker, algo: _Outer, sampler: _Sampler | None, *, spec: RunSpec, clock: int
) -> Checkpoint:
    """Copies of one stage replica's state (in the compute thread: nothing moves while it copies)."""
    opt = worker.optimizer.state_dict()
    state = {i: {k: _cpu_copy(v) if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt["state"].items()}
    groups = [{k: list(v) if k == "params" else v for k, v in g.items()} for g in opt["param_groups"]]
    extra: dict[str, Any] = {"stage": worker.stage, "stages": spec.pipeline.stages, "clock": clock}
    extra[SPEC_KEY] = spec.to_toml()
    if sampler is not None:
        extra["sampler"] = sampler.state()
    return Checkpoint(
        step=worker.step,
        spec_hash=spec.hash(),
        model={k: _cpu_copy(v) for k, v in model_tensors(worker.module).items()},
        optimizer={"state": state, "param_groups": groups},
        extra=extra,
        aux={k: _cpu_copy(v) for k, v in algo.state_dict().items()},
    )


def restore_stage(ckpt: Checkpoint, worker: StageWorker, algo: _Outer, sampler: _Sampler | None) -> int:
    """Load a stage checkpoint into a replica of that stage; returns its data clock."""
    if ckpt.extra.get("stage") != worker.stage:
        raise CheckpointError(f"the checkpoint is of stage {ckpt.extra.get('stage')}, this replica {worker.stage}")
    load_model_tensors(worker.module, ckpt.model)
    if ckpt.optimizer is not None:
        try:
            worker.optimizer.load_state_dict(ckpt.optimizer)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"the optimizer state does not fit stage {worker.stage}: {e}") from None
    try:
        algo.load_state_dict(ckpt.aux)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"the outer state does not fit stage {worker.stage}: {e}") from None
    if sampler is not None and "sampler" in ckpt.extra:
        sampler.set_state(ckpt.extra["sampler"])
    worker.step = ckpt.step
    return int(ckpt.extra.get("clock", ckpt.step))


def resume_stage_arg(ckpt: Checkpoint | None, stage_arg: int | str, where: Path) -> int | str:
    """The stage to serve: the checkpoint's under ``auto``; ``--stage K`` must match it."""
    if ckpt is None:
        return stage_arg
    saved = ckpt.extra.get("stage")
    if not isinstance(saved, int):
        raise CheckpointError(f"{where} is not a pipeline stage's checkpoint; use another --checkpoint-dir")
    if stage_arg == "auto":
        log.info("resuming stage %d from %s (its checkpoint's stage)", saved, where)
        return saved
    if int(stage_arg) != saved:
        raise CheckpointError(
            f"--stage {stage_arg}: {where} holds a checkpoint of stage {saved}; "
            f"pass --stage {saved} (or auto), or use another --checkpoint-dir"
        )
    return stage_arg


def siblings_ahead(clocks: Iterable[int], own: int, inner_steps: int) -> bool:
    """Whether the clock most siblings reached (a minority claiming far more moves it a round at most) is a
    whole round past ``own``: then their state is newer than our checkpoint."""
    return robust_top(clocks, slack=inner_steps) >= own + inner_steps


class StageCheckpoints:
    """One stage replica's checkpoints in ``directory`` (none without one): open, attach, write."""

    def __init__(self, directory: Path | None, every: int) -> None:
        self.path = Path(directory) / CHECKPOINT_NAME if directory is not None else None
        self.every = every
        self.resumed = False
        self._opened: Checkpoint | None = None
        self._parts: tuple[StageWorker, _Outer, _Sampler | None] | None = None
        self._writing: asyncio.Future[None] | None = None

    def open(self, spec: RunSpec, stage_arg: int | str, events: _Events) -> int | str:
        """Sweep, read and check the checkpoint (before the replica is built); returns the stage to serve."""
        if self.path is None:
            return stage_arg
        self._opened, aside = open_checkpoint(self.path.parent, spec.hash())
        if aside is not None:
            events.write("checkpoint_set_aside", **aside.event())
        return resume_stage_arg(self._opened, stage_arg, self.path.parent)

    def attach(self, worker: StageWorker, algo: _Outer, sampler: _Sampler | None) -> int | None:
        """Bind the built replica and load the opened checkpoint into it (compute thread); returns the
        checkpoint's data clock (a later stage's ``StageService.clock``), None when nothing was resumed."""
        self._parts = (worker, algo, sampler)
        if self._opened is None:
            return None
        clock = restore_stage(self._opened, worker, algo, sampler)
        log.info("stage %d: resumed step %d (data clock %d) from %s", worker.stage, worker.step, clock, self.path)
        self._opened, self.resumed = None, True
        return clock

    def should_sync(self, trained: list[Heartbeat], inner_steps: int, own_clock: int) -> bool:
        """Download the siblings' state? Always when we did not resume; else only when theirs is newer."""
        if not self.resumed or siblings_ahead((b.clock or b.step for b in trained), own_clock, inner_steps):
            return True
        log.info("our stage checkpoint (data clock %d) is as new as the siblings'; keeping it", own_clock)
        return False

    def due(self, round_idx: int) -> bool:
        return self.path is not None and self.every > 0 and round_idx % self.every == 0

    def capture(self, clock: int) -> Checkpoint:
        """Copies of the attached replica (compute thread); ``clock``: a later stage's data clock."""
        assert self._parts is not None, "attach() first"
        worker, algo, sampler = self._parts
        clock = worker.step if worker.stage == 0 else clock  # stage 0's data clock is its step, as of now
        return capture_stage(worker, algo, sampler, spec=worker.spec, clock=clock)

    async def write(self, compute: Callable[..., Awaitable[Any]], clock: int, *, final: bool = False) -> None:
        """Checkpoint from copies taken by ``compute`` (the host's compute thread), written in a thread.

        A periodic write skips while the previous one runs; ``final`` waits for it and for its own write.
        """
        if self.path is None or self._parts is None:
            return
        if self._writing is not None:
            if not self._writing.done() and not final:
                log.info("the previous checkpoint is still being written; skipping this one")
                return
            await asyncio.wait({self._writing})
            if (err := self._writing.exception()) is not None:
                log.warning("writing the checkpoint %s failed: %s", self.path, err)
        ckpt = await compute(self.capture, clock)
        self._writing = asyncio.get_running_loop().run_in_executor(None, save_checkpoint, self.path, ckpt)
        if final:
            try:
                await self._writing
            except OSError as e:  # a full disk: the last good checkpoint stays, the replica still leaves cleanly
                log.error("writing the checkpoint %s failed: %s", self.path, e)

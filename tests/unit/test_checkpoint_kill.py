"""Checkpoints survive any kill: SIGKILL at random points of a write, corrupt files, stage checkpoints.

The kill test forks a child (it inherits the imported torch and a real Trainer) that writes
checkpoints in a loop through ``Trainer.save``; the parent SIGKILLs it at seeded random delays
spread over one write's measured duration, then runs the real resume path on a fresh Trainer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from locomm.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    atomic_path,
    atomic_write_text,
    load_checkpoint,
    save_checkpoint,
    save_tensors_atomic,
    sweep_temp_files,
)
from locomm.config import ConfigError, RunSpec
from locomm.data import BatchSampler, load_corpus
from locomm.peer.metrics import EventLog
from locomm.peer.pipeline.checkpoint import (
    StageCheckpoints,
    capture_stage,
    restore_stage,
    resume_stage_arg,
    siblings_ahead,
)
from locomm.protocol import build_outer
from locomm.protocol.membership import Heartbeat
from locomm.train import Trainer
from locomm.train.stage import StageWorker

pytestmark = pytest.mark.timeout(120)
KILLS = 20


def _marker(trainer: Trainer) -> torch.Tensor:
    """One weight the writer sets to the step it saves: a torn file would pair one step's metadata with
    another step's tensors."""
    return next(iter(trainer.model.parameters()))


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def _writer(trainer: Trainer, directory: Path, ready: int) -> None:
    """The child: save steps 1, 2, ... for ever, telling the parent (one byte) as each write starts."""
    torch.set_num_threads(1)  # no OpenMP pool in a forked child
    step = 0
    while True:
        step += 1
        trainer.step = step
        with torch.no_grad():
            _marker(trainer).view(-1)[0] = float(step)
        os.write(ready, b"s")
        trainer.save(directory)


def test_sigkill_during_checkpoint_writes_never_tears(nano_spec, nano_splits, tmp_path):
    spec = nano_spec.replace("model", d_model=128, d_ff=384)  # ~5 MB of weights and Adam moments: a real write's length
    trainer = Trainer(spec, splits=nano_splits)
    for _ in range(2):
        trainer.train_step()  # Adam state exists, as in any checkpoint after step 1
    directory = tmp_path / "ckpt"
    t0 = time.perf_counter()
    for _ in range(3):
        trainer.save(directory)
    write_s = (time.perf_counter() - t0) / 3
    (directory / CHECKPOINT_NAME).unlink()

    fresh = Trainer(spec, splits=nano_splits)  # the resume side: each try_resume reads model, optimizer, step anew
    rng = random.Random(18)
    torn_temps = 0
    for kill in range(KILLS):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            try:
                os.close(r)
                _writer(trainer, directory, w)
            finally:
                os._exit(1)
        os.close(w)
        started = 0
        try:
            # Wait until the second write has started (the first left a checkpoint to fall back on),
            # then kill at a random point of it (or, a little past its length, of the next one).
            while started < 2:
                got = os.read(r, 64)
                assert got, "the writer died on its own"
                started += len(got)
            if kill % 2:  # half the kills aim at the file itself: a random point after the temp file appears
                deadline = time.monotonic() + 10.0
                while not _temps(directory) and time.monotonic() < deadline:
                    time.sleep(0.0005)
                time.sleep(rng.uniform(0.0, write_s / 8))
            else:  # the others anywhere in the save (serializing, writing, fsyncing, renaming)
                time.sleep(rng.uniform(0.0, write_s))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        while got := os.read(r, 64):
            started += len(got)
        os.close(r)
        torn_temps += bool(_temps(directory))

        fresh.step = -1
        ckpt = fresh.try_resume(directory)
        assert ckpt is not None and fresh.set_aside is None, f"kill {kill}: no loadable checkpoint"
        assert 1 <= fresh.step <= started, f"kill {kill}: step {fresh.step} was never written"
        assert float(_marker(fresh).detach().view(-1)[0]) == fresh.step, f"kill {kill}: a torn checkpoint"
        assert _temps(directory) == [], f"kill {kill}: temp files left after the sweep"
        assert sorted(p.name for p in directory.iterdir()) == [CHECKPOINT_NAME]
    # A save serializes in memory, then writes and fsyncs the temp file (about half of its time), then renames:
    # the kills hit every phase, and the aimed ones left a torn temp file for the sweep.
    print(f"{KILLS}/{KILLS} resumed; {torn_temps} kills left a temp file; write {write_s * 1e3:.1f} ms")
    assert torn_temps >= 3, f"only {torn_temps}/{KILLS} kills hit the temp file (write {write_s * 1e3:.1f} ms)"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "foreign"])
def test_corrupt_checkpoint_is_set_aside_and_resume_returns_none(nano_spec, nano_splits, tmp_path, caplog, damage):
    t = Trainer(nano_spec, splits=nano_splits)
    t.save(tmp_path)
    path = tmp_path / CHECKPOINT_NAME
    good = path.read_bytes()
    bad = {
        "truncated": good[: len(good) // 2],
        "garbage": random.Random(1).randbytes(4096),
        "empty": b"",
        "foreign": None,  # a valid safetensors file without our metadata
    }[damage]
    if bad is None:
        save_tensors_atomic(path, {"w": torch.zeros(3)})
        bad = path.read_bytes()
    else:
        path.write_bytes(bad)
    fresh = Trainer(nano_spec, splits=nano_splits)
    with caplog.at_level(logging.WARNING, logger="locomm.checkpoint"):
        assert fresh.try_resume(tmp_path) is None
    assert fresh.step == 0
    aside = fresh.set_aside
    assert aside is not None and aside.moved_to.name.startswith(f"{CHECKPOINT_NAME}.corrupt-")
    assert aside.moved_to.read_bytes() == bad  # kept as it was: the user's work
    assert not path.exists()
    assert set(aside.event()) == {"moved_to", "error"} and "cannot read checkpoint" in aside.event()["error"]
    assert any("moved it to" in r.getMessage() for r in caplog.records)
    # The next checkpoint is written beside the one set aside, and a second corrupt file gets its own name.
    fresh.save(tmp_path)
    path.write_bytes(b"x")
    again = Trainer(nano_spec, splits=nano_splits)
    assert again.try_resume(tmp_path) is None and again.set_aside.moved_to != aside.moved_to
    assert aside.moved_to.exists() and again.set_aside.moved_to.exists()


def test_other_spec_stays_an_error(nano_spec, nano_splits, tmp_path):
    Trainer(nano_spec, splits=nano_splits).save(tmp_path)
    other = Trainer(nano_spec.replace("inner", lr=1e-4), splits=nano_splits)
    with pytest.raises(CheckpointError, match="different run spec") as e:
        other.try_resume(tmp_path)
    assert isinstance(e.value, ConfigError)  # the CLI prints one line and exits 2
    assert (tmp_path / CHECKPOINT_NAME).exists()  # not moved: it is fine, just not this run's


def test_sweep_takes_only_our_temp_files(tmp_path, caplog):
    ours = [f".{CHECKPOINT_NAME}.abcd_123.tmp", f".{CHECKPOINT_NAME}.zz9zz9zz.tmp"]
    theirs = [
        f".{CHECKPOINT_NAME}.tmp",
        f".{CHECKPOINT_NAME}.toolongname.tmp",
        ".other.safetensors.abcd1234.tmp",
        "notes.tmp",
        CHECKPOINT_NAME,
    ]
    for name in ours + theirs:
        (tmp_path / name).write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="locomm.checkpoint"):
        swept = sweep_temp_files(tmp_path)
    assert sorted(p.name for p in swept) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)
    assert any("removed 2 temporary file(s)" in r.getMessage() for r in caplog.records)
    assert sweep_temp_files(tmp_path / "absent") == []


def test_atomic_writers_leave_no_temp_and_fail_cleanly(tmp_path):
    atomic_write_text(tmp_path / "a" / "notes.txt", "one")
    atomic_write_text(tmp_path / "a" / "notes.txt", "two")
    save_tensors_atomic(tmp_path / "w.safetensors", {"x": torch.arange(4.0).t()})
    assert (tmp_path / "a" / "notes.txt").read_text() == "two"
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "w.safetensors") as tmp:  # a writer that fails
        tmp.write_bytes(b"half a file")
        raise RuntimeError
    assert load_file(tmp_path / "w.safetensors")["x"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the old file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "w.safetensors"]
    assert _temps(tmp_path / "a") == []


# -- pipeline stage checkpoints ------------------------------------------------------


def _stage_spec() -> RunSpec:
    spec = RunSpec.preset("nano").replace("model", n_layers=2)
    spec = spec.replace("data", batch_size=4, seq_len=32, max_corpus_mb=1.0)
    return spec.replace("pipeline", stages=2, micro_batch_size=2).replace("outer", algo="noloco", inner_steps=3)


def _replica(spec: RunSpec, stage: int, splits) -> tuple[StageWorker, object, BatchSampler | None]:
    worker = StageWorker(spec, stage)
    algo = build_outer(spec.outer, worker.params(), 0)
    sampler = BatchSampler(splits, spec.data, seed=spec.train.seed) if stage == 0 else None
    return worker, algo, sampler


def _trained(spec: RunSpec, stage: int, splits, steps: int = 2):
    worker, algo, sampler = _replica(spec, stage, splits)
    g = torch.Generator().manual_seed(stage)
    for _ in range(steps):  # real inner steps on random gradients: Adam state, a moved projection
        for p in worker.module.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        worker.apply_step()
    for v in algo.state_dict().values():
        v.add_(0.5)  # an outer state that differs from a fresh one
    if sampler is not None:
        sampler.next()
    return worker, algo, sampler


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stage_checkpoint_round_trip(tmp_path):
    spec = _stage_spec()
    splits = load_corpus(spec.data)
    for stage in (0, 1):
        worker, algo, sampler = _trained(spec, stage, splits)
        path = tmp_path / f"s{stage}" / CHECKPOINT_NAME
        save_checkpoint(path, capture_stage(worker, algo, sampler, spec=spec, clock=worker.step if stage == 0 else 41))
        w2, a2, s2 = _replica(spec, stage, splits)
        clock = restore_stage(load_checkpoint(path), w2, a2, s2)
        assert clock == (worker.step if stage == 0 else 41) and w2.step == worker.step == 2
        assert _same(dict(worker.module.state_dict()), dict(w2.module.state_dict()))
        assert _same(algo.state_dict(), a2.state_dict())
        if sampler is not None:
            assert torch.equal(sampler.next()[0], s2.next()[0])
        # The next step is the same on both: the inner optimizer's state came back too.
        for w in (worker, w2):
            for p in w.module.parameters():
                p.grad = torch.ones_like(p) * 1e-2
            w.apply_step()
        assert _same(dict(worker.module.state_dict()), dict(w2.module.state_dict()))
        with pytest.raises(CheckpointError, match="stage"):
            restore_stage(load_checkpoint(path), *_replica(spec, 1 - stage, splits))


def test_stage_checkpoints_open_attach_write(tmp_path):
    spec = _stage_spec()
    splits = load_corpus(spec.data)
    events = EventLog(tmp_path / "events.jsonl")
    directory = tmp_path / "ck"
    ck = StageCheckpoints(directory, every=2)
    assert ck.open(spec, "auto", events) == "auto"  # nothing there yet
    worker, algo, _ = _trained(spec, 1, splits)
    assert ck.attach(worker, algo, None) is None and not ck.resumed
    assert [ck.due(r) for r in range(1, 5)] == [False, True, False, True]

    async def writes() -> None:
        loop = asyncio.get_running_loop()

        async def compute(fn, *args):
            return await loop.run_in_executor(None, fn, *args)

        await ck.write(compute, 30)
        await ck.write(compute, 33)  # the first may still be writing: then this one skips
        await ck.write(compute, 36, final=True)

    asyncio.run(writes())
    assert load_checkpoint(directory / CHECKPOINT_NAME).extra["clock"] == 36
    assert _temps(directory) == []
    (directory / f".{CHECKPOINT_NAME}.abcdefgh.tmp").write_bytes(b"torn")

    # A restart: auto serves the checkpoint's stage, a wrong --stage is a clear error, the right one resumes.
    again = StageCheckpoints(directory, every=2)
    assert again.open(spec, "auto", events) == 1 and _temps(directory) == []
    with pytest.raises(CheckpointError, match="--stage 0"):
        StageCheckpoints(directory, every=2).open(spec, 0, events)
    with pytest.raises(CheckpointError, match="different run spec"):
        StageCheckpoints(directory, every=2).open(spec.replace("inner", lr=1e-4), 1, events)
    w2, a2, _ = _replica(spec, 1, splits)
    assert again.open(spec, 1, events) == 1 and again.attach(w2, a2, None) == 36 and again.resumed
    assert _same(dict(worker.module.state_dict()), dict(w2.module.state_dict()))
    # Newer siblings win; ours is kept when they are within a round of it.
    beats = [Heartbeat(peer=f"p{i}", stage=1, step=9, clock=c) for i, c in enumerate((39, 40, 41))]
    assert again.should_sync(beats, spec.outer.inner_steps, 36)
    assert not again.should_sync(beats, spec.outer.inner_steps, 39)
    assert StageCheckpoints(None, every=2).should_sync(beats, spec.outer.inner_steps, 10**6)  # not resumed
    assert siblings_ahead([39, 40, 41], 36, 3) and not siblings_ahead([36, 37, 38], 36, 3)
    assert not siblings_ahead([36, 37, 10**9], 36, 3)  # one peer claiming a far-off clock is not a newer state
    # A corrupt stage checkpoint is set aside with an event; the replica starts fresh.
    (directory / CHECKPOINT_NAME).write_bytes(b"\x00" * 10)
    fresh = StageCheckpoints(directory, every=2)
    assert fresh.open(spec, 1, events) == 1 and fresh.attach(*_replica(spec, 1, splits)[:2], None) is None
    events.close()
    assert '"event": "checkpoint_set_aside"' in (tmp_path / "events.jsonl").read_text()
    assert any(p.name.startswith(f"{CHECKPOINT_NAME}.corrupt-") for p in directory.iterdir())


def test_stage_arg_against_a_data_parallel_checkpoint(nano_spec, nano_splits, tmp_path):
    t = Trainer(nano_spec, splits=nano_splits)
    t.save(tmp_path)
    ckpt = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    with pytest.raises(CheckpointError, match="not a pipeline stage's checkpoint"):
        resume_stage_arg(ckpt, "auto", tmp_path)
    assert resume_stage_arg(None, 1, tmp_path) == 1

import json
import subprocess
import sys

import pytest
import torch

from locomm.checkpoint import CheckpointError
from locomm.train import Trainer, train


def test_training_beats_unigram(nano_spec):
    spec = nano_spec.replace("train", steps=120, eval_interval=0)
    result = train(spec)
    assert result.steps == 120
    assert result.val_loss < 0.9 * result.unigram_nats


@pytest.mark.parametrize("opt", ["adamw", "adams", "adam"])
def test_optimizers_reduce_loss(nano_spec, nano_splits, opt):
    t = Trainer(nano_spec.replace("inner", name=opt), splits=nano_splits)
    before = t.evaluate()
    for _ in range(30):
        t.train_step()
    assert t.evaluate() < before - 0.5


def test_resume_continues_exactly(nano_spec, nano_splits, tmp_path):
    spec = nano_spec.replace("train", steps=20)
    straight = Trainer(spec, splits=nano_splits)
    for _ in range(20):
        straight.train_step()

    first = Trainer(spec, splits=nano_splits)
    for _ in range(10):
        first.train_step()
    first.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.safetensors"]  # no temp files left
    second = Trainer(spec, splits=nano_splits)
    assert second.try_resume(tmp_path) and second.step == 10
    for _ in range(10):
        second.train_step()
    for (n, a), (_, b) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), n


def test_checkpoint_from_other_spec_is_refused_and_corrupt_set_aside(nano_spec, nano_splits, tmp_path):
    t = Trainer(nano_spec, splits=nano_splits)
    t.save(tmp_path)
    other = Trainer(nano_spec.replace("inner", lr=1e-4), splits=nano_splits)
    with pytest.raises(CheckpointError, match="different run spec"):
        other.try_resume(tmp_path)
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    assert t.try_resume(tmp_path) is None  # a torn file is set aside (tests/unit/test_checkpoint_kill.py)
    assert t.set_aside is not None and t.set_aside.moved_to.exists()


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=240
    )


def test_cli_train_json(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\npreset = "nano"\n[data]\nmax_corpus_mb = 1.0\nseq_len = 64\n[train]\neval_batches = 2\n')
    out = run_cli(
        "train",
        "--config",
        str(cfg),
        "--steps",
        "15",
        "--device",
        "cpu",
        "--json",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("steps", "val_loss", "unigram_nats", "tokens_per_s"):
        assert key in summary
    assert summary["steps"] == 15 and summary["tokens_per_s"] > 0
    assert (tmp_path / "ck" / "checkpoint.safetensors").exists()
    again = run_cli("train", "--config", str(cfg), "--steps", "15", "--json", "--checkpoint-dir", str(tmp_path / "ck"))
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from"] == 15


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--corpus", "/no/such/dir", "--preset", "nano"], "does not exist"),
        (["train", "--config", "/no/such.toml"], "does not exist"),
        (["train", "--preset", "nano", "--steps", "0"], "train.steps"),
        (
            ["train", "--preset", "nano", "--device", "cuda:0"]
            if not torch.cuda.is_available()
            else ["train", "--preset", "nano", "--steps", "0"],
            "CUDA" if not torch.cuda.is_available() else "steps",
        ),
    ],
)
def test_cli_errors_are_one_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr

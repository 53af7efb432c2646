"""Memory plans: the estimate against torch's own allocations, the search, and accumulation/checkpointing parity."""

import dataclasses
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from locomm.config import ConfigError, DataConfig, ModelConfig, RunSpec
from locomm.model import build_model
from locomm.optim import build_optimizer
from locomm.train import MemoryPlan, Trainer, plan_memory
from locomm.train.plan import GIB, block_saved, estimate, head_saved, parameter_count


def _plan(spec: RunSpec, micro: int, *, checkpointing: bool = False) -> MemoryPlan:
    base = plan_memory(spec, device="cpu", max_memory_gb=64)
    return dataclasses.replace(
        base, micro_batch=micro, accumulation=spec.data.batch_size // micro, checkpointing=checkpointing
    )


def _peak_bytes(fn) -> tuple[int, int]:
    """(peak, end) of the CPU allocator's bytes allocated while ``fn`` runs, from torch.profiler's events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    cur = peak = 0
    for e in events:
        if e.get("name") == "[memory]":
            cur += e["args"]["Bytes"]
            peak = max(peak, cur)
    return peak, cur


# -- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True])
def test_accumulation_matches_the_full_batch_step(nano_spec, nano_splits, checkpointing):
    spec = nano_spec.replace("inner", warmup_steps=0)  # full LR from step 0: differences show
    full = Trainer(spec, splits=nano_splits)
    accum = Trainer(spec, splits=nano_splits, plan=_plan(spec, spec.data.batch_size // 4, checkpointing=checkpointing))
    assert accum.accumulation == 4 and accum.model.checkpointing is checkpointing
    for _ in range(2):
        assert accum.train_step() == pytest.approx(full.train_step(), abs=1e-5)
    assert accum.sampler.state() == full.sampler.state()  # the same batches were drawn
    assert accum.evaluate() == pytest.approx(full.evaluate(), abs=1e-4)
    diffs = [(a - b).abs().max().item() for a, b in zip(full.model.parameters(), accum.model.parameters())]
    assert max(diffs) < 1e-4
    moved = [(a - b).abs().max().item() for a, b in zip(full.model.parameters(), build_model(spec.model).parameters())]
    assert max(moved) > 1e-3  # the steps did move the weights


def test_checkpointing_gives_the_same_gradients_and_saves_less():
    cfg = ModelConfig.from_preset("nano")
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    grads, ends = [], []
    for on in (False, True):
        model = build_model(cfg, seed=3)
        model.checkpointing = on
        out: list[torch.Tensor] = []
        ends.append(_peak_bytes(lambda m=model, o=out: o.append(m(tokens[:, :-1], tokens[:, 1:])))[1])
        out[0].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=0, msg=name)
    assert ends[1] < ends[0] / 3  # what the forward kept for backward


# -- the estimate against torch --------------------------------------------------------------


def test_saved_activations_match_the_model_exactly():
    cfg = ModelConfig(d_model=128, n_layers=2, n_heads=4, d_ff=352, max_seq_len=128)
    model = build_model(cfg)
    tokens = torch.randint(0, 256, (2, 129))
    out: list[torch.Tensor] = []  # holds the loss, so its graph lives past the profile
    kept = _peak_bytes(lambda: out.append(model(tokens[:, :-1], tokens[:, 1:])))[1]
    predicted = 2 * 128 * (cfg.n_layers * block_saved(cfg, False) + head_saved(cfg, False))
    assert abs(kept - predicted) <= 0.02 * predicted, (kept, predicted)


@pytest.mark.parametrize("micro,checkpointing", [(4, False), (1, False), (1, True)])
def test_step_peak_is_within_the_estimate(micro, checkpointing):
    spec = RunSpec(
        model=ModelConfig(d_model=128, n_layers=3, n_heads=4, d_ff=352, max_seq_len=128),
        data=DataConfig(seq_len=128, batch_size=4),
    )
    model = build_model(spec.model)
    model.checkpointing = checkpointing
    opt = build_optimizer(model.parameters(), spec.inner)
    tokens = torch.randint(0, 256, (4, 129))
    n = 4 // micro

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for chunk in tokens.chunk(n):
            (model(chunk[:, :-1], chunk[:, 1:]) / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    step()  # the optimizer's state exists from here on
    opt.zero_grad(set_to_none=True)
    held = sum(p.numel() * 4 for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
    )
    measured = held + _peak_bytes(step)[0]
    est = estimate(spec, micro, autocast=False, checkpointing=checkpointing)["peak"]
    assert measured <= est <= 1.3 * measured, (measured, est)


# -- the search ---------------------------------------------------------------------------------


def test_small_preset_plans_fit_their_budgets():
    spec = RunSpec.preset("small")
    plans = {gb: plan_memory(spec, device="cuda", max_memory_gb=gb) for gb in (8, 4, 3)}
    for gb, p in plans.items():
        assert p.micro_batch * p.accumulation == spec.data.batch_size
        assert p.est_peak_bytes <= p.usable_bytes < p.budget_bytes == gb * GIB
        assert p.weights_bytes == 4 * parameter_count(spec.model)
        json.dumps(p.as_json())
    assert plans[8].micro_batch > plans[4].micro_batch
    assert plans[3].autocast or plans[3].checkpointing  # fp32 does not fit 3 GiB at micro-batch 1
    assert "accumulation" in plans[8].describe() and "GiB" in plans[8].describe()
    for name in ("nano", "tiny"):
        cfg = ModelConfig.from_preset(name)
        assert parameter_count(cfg) == build_model(cfg).num_parameters()


def test_cpu_plans_never_autocast():
    spec = RunSpec.preset("small")
    p = plan_memory(spec, device="cpu", max_memory_gb=2.5)
    assert p.checkpointing and not p.autocast and "CPU" in p.describe()
    assert plan_memory(spec, device="cuda", max_memory_gb=2.5).autocast


def test_impossible_budget_says_what_it_needs():
    with pytest.raises(ConfigError, match=r"needs about 2\.\d\d GiB .* than 0\.45 GiB usable of the 0\.50 GiB"):
        plan_memory(RunSpec.preset("small"), device="cuda", max_memory_gb=0.5)
    with pytest.raises(ConfigError, match="must be > 0"):
        plan_memory(RunSpec.preset("nano"), device="cpu", max_memory_gb=0)


def test_default_budget_on_cpu_is_available_ram():
    p = plan_memory(RunSpec.preset("nano"), device="cpu")
    assert p.budget_source == "MemAvailable" and p.budget_bytes > 0


def test_pipeline_specs_plan_one_stage(nano_spec):
    spec = nano_spec.replace("pipeline", stages=2, micro_batch_size=2)
    p = plan_memory(spec, device="cuda", max_memory_gb=1)
    assert p.stage_mode and p.micro_batch == 2 and p.accumulation == 1 and not p.checkpointing
    assert re.search("stage", p.describe())
    with pytest.raises(ValueError, match="does not cover"):
        Trainer(nano_spec, plan=p)
    with pytest.raises(ValueError, match="does not cover"):
        Trainer(nano_spec, plan=dataclasses.replace(_plan(nano_spec, 2), accumulation=2))


def test_prefer_autocast_starts_with_bf16_on_cuda_only():
    spec = RunSpec.preset("small")
    assert not plan_memory(spec, device="cuda", max_memory_gb=24).autocast
    assert plan_memory(spec, device="cuda", max_memory_gb=24, prefer_autocast=True).autocast
    assert not plan_memory(spec, device="cpu", max_memory_gb=24, prefer_autocast=True).autocast


@pytest.mark.parametrize("branch_norm", [False, True])
def test_a_checkpointed_stage_gives_the_same_gradients(nano_spec, branch_norm):
    """A pipeline stage recomputing its blocks in backward (a plan's checkpointing) moves the same gradients, into
    its parameters and back to the previous stage."""
    from locomm.model.stages import build_stage  # noqa: PLC0415

    spec = nano_spec.replace("pipeline", stages=2, branch_norm=branch_norm)
    grads = []
    for on in (False, True):
        stage = build_stage(spec, 1)
        stage.train()
        stage.checkpointing = on
        h = torch.randn(2, 16, spec.model.d_model, generator=torch.Generator().manual_seed(0), requires_grad=True)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        stage(tokens, h).square().mean().backward()
        grads.append([h.grad.clone(), *(p.grad.clone() for p in stage.parameters())])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_stage_plan_checkpoints_when_fp32_does_not_fit():
    spec = RunSpec.preset("small").replace("pipeline", stages=2, micro_batch_size=4, in_flight=4)
    roomy = plan_memory(spec, device="cuda", max_memory_gb=64)
    assert roomy.stage_mode and not roomy.checkpointing and not roomy.autocast
    need = estimate(spec, 4, autocast=True, checkpointing=True)["peak"]
    tight = plan_memory(spec, device="cuda", max_memory_gb=need / GIB / 0.85)
    assert tight.checkpointing and tight.autocast and tight.micro_batch == 4

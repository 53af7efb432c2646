"""``locomm-peer train`` and ``locomm-peer simulate``: the commands that run on this machine alone.

``train`` is the single-node baseline; ``simulate`` runs N virtual workers (or a pipeline of S stages x R
replicas) in one process over the network cost model of :mod:`locomm.sim`. Torch is imported inside each
command, never at import.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from locomm.cli.options import PRESETS, emit_json, fail, load_spec, parse_pipeline
from locomm.config import ConfigError, RunSpec
from locomm.config.training import SHARDINGS


@click.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Run spec (TOML).")
@click.option("--preset", type=PRESETS, help="Model size preset (default: nano, or $LOCOMM_PRESET).")
@click.option("--steps", type=int, help="Inner steps (overrides train.steps).")
@click.option(
    "--device",
    default=lambda: os.environ.get("LOCOMM_DEVICE", "auto"),
    show_default="auto",
    help="cpu, cuda, cuda:N or auto.",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Checkpoint here (atomically) and resume from it when it holds one.",
)
@click.option("--corpus", help="Override data.corpus: 'stdlib', a text file/folder, a .bin file, hf:NAME.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
def train(
    config: str | None,
    preset: str | None,
    steps: int | None,
    device: str,
    checkpoint_dir: Path | None,
    corpus: str | None,
    as_json: bool,
) -> None:
    """Train a model on this machine alone (the single-node baseline)."""
    try:
        spec = load_spec(config, preset)
        if steps is not None:
            spec = spec.replace("train", steps=steps)
        if corpus is not None:
            spec = spec.replace("data", corpus=corpus)
    except ConfigError as e:
        fail(str(e))
    from locomm.cli.progress import run_train  # noqa: PLC0415 - imports torch

    result = run_train(spec, device=device, checkpoint_dir=checkpoint_dir, quiet=as_json)
    if as_json:
        emit_json(result)


@click.command()
@click.option(
    "--algo",
    type=click.Choice(["ddp", "diloco", "noloco", "gasloc", "sparseloco", "scape"]),
    help="Outer algorithm (required, except with --pipeline: replica sync, default noloco). scape: one island "
    "syncing every step with SCAPE against dense AdamS and AdamW DDP and top-k on raw gradients "
    "(--rounds x --inner-steps steps).",
)
@click.option(
    "--sparsity",
    type=float,
    help="With --algo scape: outer.scape_sparsity, the share of coordinates not sent (0.9, 0.99; 0: dense AdamS).",
)
@click.option(
    "--baselines/--no-baselines",
    default=True,
    show_default=True,
    help="With --algo scape: also run dense AdamS DDP, dense AdamW DDP and top-k on raw gradients.",
)
@click.option(
    "--pipeline",
    "pipeline_shape",
    help="STAGESxREPLICAS, e.g. 2x2: pipeline mode (stages of the "
    "model, subspace-compressed activations, random routing); --rounds x --inner-steps optimizer steps.",
)
@click.option("--no-subspace", is_flag=True, help="With --pipeline: send activations uncompressed (comparison).")
@click.option("--workers", type=int, default=8, show_default=True, help="Virtual workers (2-64).")
@click.option("--rounds", type=int, default=10, show_default=True, help="Outer rounds.")
@click.option("--inner-steps", type=int, help="H, inner steps per round (overrides outer.inner_steps).")
@click.option("--link", default="80mbit", show_default=True, help="Per-worker link speed: 80mbit, 1gbit, 10gbit...")
@click.option("--latency-ms", type=float, default=30.0, show_default=True, help="One-way latency between peers.")
@click.option(
    "--heterogeneity",
    type=float,
    default=0.0,
    show_default=True,
    help="0: identical workers; X: link and compute speeds spread over 10^X (stragglers).",
)
@click.option(
    "--tflops",
    type=float,
    default=10.0,
    show_default=True,
    help="Effective compute per worker, for the simulated timeline.",
)
@click.option("--preset", type=PRESETS, help="Model preset (default nano).")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Run spec (TOML).")
@click.option(
    "--codec",
    default=None,
    help="Codec stack for every payload tensor, e.g. none (raw fp32), "
    "bf16+lossless (default: the run spec's compression per tensor role, as the daemon sends).",
)
@click.option("--eval-every", type=int, default=1, show_default=True, help="Evaluate every this many rounds.")
@click.option(
    "--seed", type=int, help="Overrides train.seed and outer.seed together (model init, data order and grouping)."
)
@click.option(
    "--sharding",
    type=click.Choice(SHARDINGS),
    help="Overrides data.sharding: what each worker samples (default iid: the whole training split).",
)
@click.option(
    "--no-overlap",
    is_flag=True,
    help="Block on each exchange (the daemon's --no-overlap); default: "
    "the daemon's schedule, each exchange applied one round late while the next round computes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write loss vs step and vs time (PNG).")
def simulate(
    algo: str | None,
    sparsity: float | None,
    baselines: bool,
    pipeline_shape: str | None,
    no_subspace: bool,
    workers: int,
    rounds: int,
    inner_steps: int | None,
    link: str,
    latency_ms: float,
    heterogeneity: float,
    tflops: float,
    preset: str | None,
    config: str | None,
    codec: str | None,
    eval_every: int,
    seed: int | None,
    sharding: str | None,
    no_overlap: bool,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Compare outer algorithms on N virtual workers with a network cost model."""
    if pipeline_shape is not None:
        _simulate_pipeline(
            pipeline_shape,
            algo,
            no_subspace,
            rounds,
            inner_steps,
            link,
            latency_ms,
            tflops,
            preset,
            config,
            seed,
            sharding,
            as_json,
        )
        return
    if algo == "scape":
        _simulate_scape(
            sparsity,
            baselines,
            workers,
            rounds,
            inner_steps,
            link,
            latency_ms,
            tflops,
            preset,
            config,
            eval_every,
            seed,
            sharding,
            as_json,
        )
        return
    try:
        if sparsity is not None:
            raise ConfigError("--sparsity goes with --algo scape")
        if algo is None:
            raise ConfigError("--algo is required (or give --pipeline SxR)")
        spec = load_spec(config, preset)
        spec = spec.replace("outer", algo=algo, **({"inner_steps": inner_steps} if inner_steps is not None else {}))
        spec = _seeded(spec, seed, sharding)
        if rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        # The inner LR schedule spans the whole simulated run.
        spec = spec.replace("train", steps=rounds * spec.outer.inner_steps)
        from locomm.sim.network import parse_link  # noqa: PLC0415 - numpy only

        link_bps = parse_link(link)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    from locomm.cli.progress import run_simulation  # noqa: PLC0415 - imports torch

    result = run_simulation(
        spec,
        workers=workers,
        rounds=rounds,
        link_bps=link_bps,
        latency_s=latency_ms / 1000,
        heterogeneity=heterogeneity,
        tflops=tflops,
        codec=codec,
        eval_every=eval_every,
        quiet=as_json,
        plot=plot,
        overlap=not no_overlap,
    )
    if as_json:
        emit_json(result)


def _seeded(spec: RunSpec, seed: int | None, sharding: str | None) -> RunSpec:
    """``--seed`` (train.seed and outer.seed together) and ``--sharding`` applied to ``spec``."""
    if seed is not None:
        spec = spec.replace("train", seed=seed).replace("outer", seed=seed)
    return spec if sharding is None else spec.replace("data", sharding=sharding)


def _simulate_pipeline(
    shape: str,
    algo: str | None,
    no_subspace: bool,
    rounds: int,
    inner_steps: int | None,
    link: str,
    latency_ms: float,
    tflops: float,
    preset: str | None,
    config: str | None,
    seed: int | None,
    sharding: str | None,
    as_json: bool,
) -> None:
    try:
        from locomm.sim.network import parse_link  # noqa: PLC0415 - numpy only

        stages, replicas = parse_pipeline(shape)
        spec = load_spec(config, preset)
        spec = spec.replace("pipeline", stages=stages, **({"subspace": False} if no_subspace else {}))
        spec = spec.replace(
            "outer",
            algo=algo or (spec.outer.algo if spec.outer.algo != "none" else "noloco"),
            **({"inner_steps": inner_steps} if inner_steps is not None else {}),
        )
        spec = _seeded(spec, seed, sharding)
        if rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        steps = rounds * spec.outer.inner_steps
        spec = spec.replace("train", steps=steps)
        link_bps = parse_link(link)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    from locomm.sim.pipeline import run_pipeline_simulation  # noqa: PLC0415 - imports torch

    result = run_pipeline_simulation(
        spec,
        replicas=replicas,
        steps=steps,
        link_bps=link_bps,
        latency_s=latency_ms / 1000,
        tflops=tflops,
        subspace=None,
        quiet=as_json,
    )
    if as_json:
        emit_json(result)


def _simulate_scape(
    sparsity: float | None,
    baselines: bool,
    workers: int,
    rounds: int,
    inner_steps: int | None,
    link: str,
    latency_ms: float,
    tflops: float,
    preset: str | None,
    config: str | None,
    eval_every: int,
    seed: int | None,
    sharding: str | None,
    as_json: bool,
) -> None:
    """``simulate --algo scape``: one island of ``workers``, SCAPE every step, against its baselines."""
    try:
        from locomm.sim.network import parse_link  # noqa: PLC0415 - numpy only

        spec = load_spec(config, preset)
        if inner_steps is not None:
            spec = spec.replace("outer", inner_steps=inner_steps)
        if sparsity is not None:
            spec = spec.replace("outer", scape_sparsity=sparsity)
        spec = _seeded(spec, seed, sharding)
        if rounds < 1 or not 2 <= workers <= 64:
            raise ConfigError(f"--rounds must be >= 1 and --workers in [2, 64], got {rounds} and {workers}")
        steps = rounds * spec.outer.inner_steps
        link_bps = parse_link(link)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    from locomm.data import CorpusError, load_corpus  # noqa: PLC0415 - imports torch
    from locomm.sim.scape import Cost, format_table, methods_for, run_method, summary  # noqa: PLC0415

    cost = Cost(link_bps=link_bps, latency_s=latency_ms / 1000, tflops=tflops)
    say = (lambda _m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        splits = load_corpus(spec.data)
    except CorpusError as e:
        fail(str(e))
    say(
        f"scape x{workers}: {steps} steps of {spec.model.preset}, sparsity {spec.outer.scape_sparsity}, error "
        f"feedback {'on' if spec.outer.scape_error_feedback else 'off'}; inner optimizer AdamS for scape, adams_ddp "
        f"and topk_raw (inner.name={spec.inner.name!r} is not used), AdamW for adamw_ddp"
    )
    results = []
    for method in methods_for(spec.outer.scape_sparsity, baselines):
        try:
            r = run_method(
                spec, workers, steps, method, splits=splits, eval_every=eval_every * spec.outer.inner_steps, cost=cost
            )
        except FloatingPointError as e:
            fail(str(e))
        say(f"  {method}: val {r.final_val_loss:.4f} ({r.real_s:.0f} s)")
        results.append(r)
    out = summary(spec, results, cost)
    if as_json:
        emit_json(out)
        return
    click.echo(format_table(out["table"]))
    click.echo(
        f"bytes: one worker's message per step (fp32 values + LEB128 indices), dense {results[0].dense_bytes:.0f}; "
        f"sim time: cost model at {link} / {latency_ms:g} ms, {tflops:g} TFLOP/s per worker"
    )

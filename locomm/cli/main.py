"""``locomm-peer``: the command line. Thin: parse, load the run spec, call into the package.

Heavy imports (torch, hivemind) happen inside the commands, so ``--help`` is instant.
Errors a user can fix (bad config, missing corpus, bad checkpoint) print one line
and exit with status 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from locomm import __version__
from locomm.config import MODEL_PRESETS, ConfigError, RunSpec

PRESETS = click.Choice(sorted(MODEL_PRESETS))


def load_spec(config: str | None, preset: str | None) -> RunSpec:
    """The run spec from --config (TOML) or --preset; the two together: preset sizes, then the file."""
    if config:
        spec = RunSpec.load(config)
        if preset and preset != spec.model.preset:
            raise ConfigError(f"--preset {preset} conflicts with model.preset={spec.model.preset!r} in {config}")
        return spec
    return RunSpec.preset(preset or os.environ.get("LOCOMM_PRESET", "tiny"))


def fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(2)


def emit_json(obj: dict[str, Any]) -> None:
    """The last line of stdout: one JSON object."""
    click.echo(json.dumps(obj, sort_keys=True))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="locomm-peer")
def cli() -> None:
    """locomm: train a language model across peers on consumer links."""


@cli.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Run spec (TOML).")
@click.option("--preset", type=PRESETS, help="Model size preset (default: tiny, or $LOCOMM_PRESET).")
@click.option("--steps", type=int, help="Inner steps (overrides train.steps).")
@click.option("--device", default=lambda: os.environ.get("LOCOMM_DEVICE", "auto"), show_default="auto",
              help="cpu, cuda, cuda:N or auto.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Checkpoint here (atomically) and resume from it when it holds one.")
@click.option("--corpus", help="Override data.corpus: 'stdlib', a text file/folder, a .bin file, hf:NAME.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
def train(config: str | None, preset: str | None, steps: int | None, device: str, checkpoint_dir: Path | None,
          corpus: str | None, as_json: bool) -> None:
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


@cli.command()
@click.option("--algo", type=click.Choice(["ddp", "diloco", "noloco", "gasloc", "sparseloco"]), required=True)
@click.option("--workers", type=int, default=8, show_default=True, help="Virtual workers (2-64).")
@click.option("--rounds", type=int, default=10, show_default=True, help="Outer rounds.")
@click.option("--inner-steps", type=int, help="H, inner steps per round (overrides outer.inner_steps).")
@click.option("--link", default="80mbit", show_default=True, help="Per-worker link speed: 80mbit, 1gbit, 10gbit...")
@click.option("--latency-ms", type=float, default=30.0, show_default=True, help="One-way latency between peers.")
@click.option("--heterogeneity", type=float, default=0.0, show_default=True,
              help="0: identical workers; X: link and compute speeds spread over 10^X (stragglers).")
@click.option("--tflops", type=float, default=10.0, show_default=True,
              help="Effective compute per worker, for the simulated timeline.")
@click.option("--preset", type=PRESETS, help="Model preset (default nano).")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Run spec (TOML).")
@click.option("--codec", default="none", show_default=True, help="Codec for dense payload tensors (none: raw fp32).")
@click.option("--eval-every", type=int, default=1, show_default=True, help="Evaluate every this many rounds.")
@click.option("--seed", type=int, help="Overrides train.seed (model init and data order).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write loss vs step and vs time (PNG).")
def simulate(algo: str, workers: int, rounds: int, inner_steps: int | None, link: str, latency_ms: float,
             heterogeneity: float, tflops: float, preset: str | None, config: str | None, codec: str,
             eval_every: int, seed: int | None, as_json: bool, plot: Path | None) -> None:
    """Compare outer algorithms on N virtual workers with a network cost model."""
    try:
        spec = load_spec(config, preset or (None if config else "nano"))
        spec = spec.replace("outer", algo=algo, **({"inner_steps": inner_steps} if inner_steps is not None else {}))
        if seed is not None:
            spec = spec.replace("train", seed=seed)
        if rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        # The inner LR schedule spans the whole simulated run.
        spec = spec.replace("train", steps=rounds * spec.outer.inner_steps)
        from locomm.sim.network import parse_link  # noqa: PLC0415 - numpy only

        link_bps = parse_link(link)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    from locomm.cli.progress import run_simulation  # noqa: PLC0415 - imports torch

    result = run_simulation(spec, workers=workers, rounds=rounds, link_bps=link_bps, latency_s=latency_ms / 1000,
                            heterogeneity=heterogeneity, tflops=tflops, codec=codec, eval_every=eval_every,
                            quiet=as_json, plot=plot)
    if as_json:
        emit_json(result)


@cli.group()
def bench() -> None:
    """Micro-benchmarks."""


@bench.command("codecs")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--quick", is_flag=True, help="Small tensors (seconds, not minutes).")
def bench_codecs(as_json: bool, quick: bool) -> None:
    """Compression ratio and speed of every codec, beside zstd and lz4."""
    from locomm.compression import bench as codec_bench  # noqa: PLC0415

    codec_bench.run(json_lines=as_json, quick=quick)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

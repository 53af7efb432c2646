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

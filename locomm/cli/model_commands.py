"""``locomm-peer export``, ``generate`` and ``eval``: what a run's checkpoint(s) hold, as a model.

All three read the same thing (:func:`locomm.model.hf.load_weights`): a data-parallel node's checkpoint
folder, or one stage checkpoint per pipeline stage (``--checkpoint-dir`` repeated, or a folder of them),
outer weights (phi) by default when the checkpoint holds them. ``export`` writes a Hugging Face Llama
folder; ``generate`` and ``eval`` run locomm's own model (no ``transformers`` needed).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from locomm.cli.options import PRESETS, emit_json, fail, load_spec
from locomm.config import ConfigError

_WEIGHTS = click.Choice(["outer", "local"])


def _checkpoint_options(f):
    f = click.option(
        "--preset", type=PRESETS, help="Fallback run spec for a checkpoint that carries none (its hash must match)."
    )(f)
    f = click.option(
        "--config", "config", type=click.Path(dir_okay=False), help="Fallback run spec (TOML), as --preset."
    )(f)
    f = click.option(
        "--weights",
        type=_WEIGHTS,
        help="outer: the outer algorithm's weights (phi); local: the replica's own. Default: outer when present.",
    )(f)
    return click.option(
        "--checkpoint-dir",
        "checkpoint_dirs",
        multiple=True,
        required=True,
        type=click.Path(path_type=Path),
        help="A checkpoint folder; repeat it (or give a folder of them) for a pipeline's stages.",
    )(f)


def _load(checkpoint_dirs: tuple[Path, ...], weights: str | None, config: str | None, preset: str | None):
    """The model weights, or a one-line error (exit 2)."""
    try:
        given = load_spec(config, preset) if (config or preset) else None
        from locomm.model.hf import load_weights  # noqa: PLC0415 - imports torch

        return load_weights(checkpoint_dirs, weights=weights, given=given)
    except ConfigError as e:
        fail(str(e))


def _device(device: str):
    from locomm.train.trainer import resolve_device  # noqa: PLC0415 - imports torch

    try:
        return resolve_device(device)
    except (ValueError, RuntimeError) as e:
        fail(f"--device: {e}")


@click.command()
@_checkpoint_options
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Folder to write.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
def export(
    checkpoint_dirs: tuple[Path, ...],
    weights: str | None,
    config: str | None,
    preset: str | None,
    out: Path,
    dtype: str,
    as_json: bool,
) -> None:
    """Write a checkpoint's model as a Hugging Face Llama folder (LlamaForCausalLM.from_pretrained loads it)."""
    w = _load(checkpoint_dirs, weights, config, preset)
    from locomm.model.hf import write_hf  # noqa: PLC0415

    try:
        files = write_hf(out, w, dtype)
    except (ConfigError, OSError) as e:
        fail(str(e))
    n = sum(v.numel() for v in w.tensors.values())
    if as_json:
        emit_json({"out": str(out), "source": w.source, "parameters": n, "files": [p.name for p in files]})
        return
    click.echo(f"exported {w.source}: {n:,} parameters ({dtype}) to {out}")
    click.echo(f"  files: {', '.join(p.name for p in files)}")


@click.command()
@_checkpoint_options
@click.option("--prompt", default="", help="Text to continue (UTF-8; one token per byte).")
@click.option("--max-bytes", type=click.IntRange(min=0), default=200, show_default=True, help="Bytes to generate.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True, help="0: greedy (argmax).")
@click.option("--top-k", type=click.IntRange(min=1), help="Sample among the k likeliest bytes only.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=lambda: os.environ.get("LOCOMM_DEVICE", "cpu"), show_default="cpu")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON line: the prompt, the continuation, the settings."
)
def generate(
    checkpoint_dirs: tuple[Path, ...],
    weights: str | None,
    config: str | None,
    preset: str | None,
    prompt: str,
    max_bytes: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    device: str,
    as_json: bool,
) -> None:
    """Print the prompt and the model's continuation (bytes that are not UTF-8 show as U+FFFD)."""
    w = _load(checkpoint_dirs, weights, config, preset)
    from locomm.model.hf import build_model_from, sample  # noqa: PLC0415

    model = build_model_from(w, _device(device))
    data = prompt.encode("utf-8")
    new = sample(model, list(data), max_new=max_bytes, temperature=temperature, top_k=top_k, seed=seed)
    continuation = bytes(t for t in new if t < 256)
    if as_json:
        emit_json(
            {
                "source": w.source,
                "prompt": prompt,
                "continuation": continuation.decode("utf-8", errors="replace"),
                "continuation_bytes": len(continuation),
                "temperature": temperature,
                "top_k": top_k,
                "seed": seed,
            }
        )
        return
    click.echo(bytes(data + continuation).decode("utf-8", errors="replace"))


@click.command("eval")
@_checkpoint_options
@click.option("--device", default=lambda: os.environ.get("LOCOMM_DEVICE", "auto"), show_default="auto")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line.")
def eval_command(
    checkpoint_dirs: tuple[Path, ...],
    weights: str | None,
    config: str | None,
    preset: str | None,
    device: str,
    as_json: bool,
) -> None:
    """Validation loss (nats/byte) and bits per byte on the run's held-out split, as training reports it."""
    w = _load(checkpoint_dirs, weights, config, preset)
    import torch  # noqa: PLC0415

    from locomm.data import CorpusError, eval_batches, load_corpus  # noqa: PLC0415
    from locomm.model.hf import build_model_from  # noqa: PLC0415

    spec = w.spec
    try:
        batches = eval_batches(load_corpus(spec.data).val, spec.data, spec.train.eval_batches)
    except CorpusError as e:
        fail(f"the run's corpus: {e}")
    dev = _device(device)
    model = build_model_from(w, dev)
    with torch.no_grad():  # Trainer.evaluate's convention: the mean of the batches' mean losses
        loss = sum(model(x.to(dev), y.to(dev)).item() for x, y in batches) / len(batches)
    bpb = loss / math.log(2)
    tokens = sum(x.numel() for x, _ in batches)
    if as_json:
        emit_json({"val_loss": loss, "bits_per_byte": bpb, "tokens": tokens, "source": w.source})
        return
    click.echo(f"{w.source}")
    click.echo(f"val loss {loss:.4f} nats/byte, {bpb:.4f} bits/byte over {tokens:,} held-out bytes")

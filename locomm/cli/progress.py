"""Rich progress display for long commands (imported lazily: it pulls in torch)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from locomm.checkpoint import CheckpointError
from locomm.config import RunSpec
from locomm.data import CorpusError


def progress_bar(console: Console, quiet: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=console, disable=quiet, transient=False)


def run_train(spec: RunSpec, *, device: str, checkpoint_dir: Path | None, quiet: bool) -> dict[str, Any]:
    """Train with a progress bar (step, loss, tokens/s, ETA); returns the JSON summary."""
    import torch  # noqa: PLC0415

    from locomm.train import resolve_device, train  # noqa: PLC0415

    console = Console(stderr=True)
    try:
        dev = resolve_device(device)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    last_val: list[float] = []
    with progress_bar(console, quiet) as bar:
        task = bar.add_task("train", total=spec.train.steps, info="")

        def on_step(step: int, loss: float, tps: float) -> None:
            val = f" val {last_val[-1]:.3f}" if last_val else ""
            bar.update(task, completed=step, info=f"loss {loss:.3f}{val} | {tps:,.0f} tok/s")

        def on_eval(step: int, val: float) -> None:
            last_val.append(val)

        try:
            if not quiet:
                console.print(f"locomm: preset {spec.model.preset}, {spec.train.steps} steps on {dev}, "
                              f"torch {torch.__version__}, spec {spec.hash()[:12]}")
            result = train(spec, device=dev, checkpoint_dir=checkpoint_dir, on_step=on_step, on_eval=on_eval)
        except (CorpusError, CheckpointError, FloatingPointError) as e:
            console.print(f"[red]error:[/] {e}")
            sys.exit(2)
        except KeyboardInterrupt:
            where = f"; checkpoint saved in {checkpoint_dir}" if checkpoint_dir else " (no --checkpoint-dir: not saved)"
            console.print(f"interrupted{where}")
            sys.exit(130)
    out = result.as_json()
    if not quiet:
        console.print(f"done: {out['steps']} steps, val {out['val_loss']:.4f} nats/byte "
                      f"({out['val_bits_per_byte']:.3f} bits/byte; unigram {out['unigram_nats']:.4f}), "
                      f"{out['tokens_per_s']:,.0f} tokens/s, {out['parameters']:,} parameters")
    return out

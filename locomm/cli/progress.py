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
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
        transient=False,
    )


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
                console.print(
                    f"locomm: preset {spec.model.preset}, {spec.train.steps} steps on {dev}, "
                    f"torch {torch.__version__}, spec {spec.hash()[:12]}"
                )
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
        console.print(
            f"done: {out['steps']} steps, val {out['val_loss']:.4f} nats/byte "
            f"({out['val_bits_per_byte']:.3f} bits/byte; unigram {out['unigram_nats']:.4f}), "
            f"{out['tokens_per_s']:,.0f} tokens/s, {out['parameters']:,} parameters"
        )
    return out


def run_simulation(
    spec: RunSpec,
    *,
    workers: int,
    rounds: int,
    link_bps: float,
    latency_s: float,
    heterogeneity: float,
    tflops: float,
    codec: str,
    eval_every: int,
    quiet: bool,
    plot: Path | None,
    overlap: bool = True,
) -> dict[str, Any]:
    """Run the simulator with a progress bar over rounds; returns the JSON summary.

    The run lives on its network (the daemon's schedule and deadlines decide whose payload arrives in
    time), so the numerics are this network's."""
    from locomm.config import ConfigError  # noqa: PLC0415
    from locomm.model import build_model  # noqa: PLC0415
    from locomm.sim import NetworkModel, Simulator  # noqa: PLC0415
    from locomm.sim.network import flops_step_s  # noqa: PLC0415

    console = Console(stderr=True)
    try:
        params = build_model(spec.model).num_parameters()
        step_s = flops_step_s(params, spec.data.batch_size * spec.data.seq_len, tflops)
        net = NetworkModel.build(
            workers,
            link_bps=link_bps,
            latency_s=latency_s,
            heterogeneity=heterogeneity,
            step_s=step_s,
            seed=spec.train.seed,
        )
        sim = Simulator(spec, workers, codec=codec, eval_every=eval_every, overlap=overlap, network=net)
    except (ConfigError, CorpusError, ValueError) as e:
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    with progress_bar(console, quiet) as bar:
        task = bar.add_task(f"{spec.outer.algo} x{workers}", total=rounds, info="")

        def on_round(r: int, res: Any) -> None:
            bar.update(task, completed=r + 1, info=f"val {res.val_loss[-1]:.3f} | train {res.train_loss[-1]:.3f}")

        try:
            res = sim.run(rounds, on_round=on_round)
        except FloatingPointError as e:
            console.print(f"[red]error:[/] {e}")
            sys.exit(2)
    tl = res.timeline
    wall, done, util = tl.wall(), res.round_done, tl.compute_utilisation()
    out = {
        "algo": spec.outer.algo,
        "workers": workers,
        "rounds": rounds,
        "inner_steps": spec.outer.inner_steps,
        "sharding": spec.data.sharding,
        "seed": spec.train.seed,
        "outer_seed": spec.outer.seed,
        "final_val_loss": res.final_val_loss,
        "initial_val_loss": res.val_loss[0],
        "final_val_spread": res.val_spread[-1],
        "bytes_sent_per_worker": sum(res.bytes_sent) / workers,
        "bytes_received_per_worker": sum(res.bytes_received) / workers,
        "sim_wall_clock_s": wall,
        "compute_utilisation": {"mean": sum(util) / len(util), "min": min(util), "per_worker": util},
        "overlap": overlap,
        "partners_skipped": tl.skipped,
        "transfers_cut": tl.cut,
        "max_weight_distance": sim.weight_distance(),
        "link_bps": link_bps,
        "latency_s": latency_s,
        "heterogeneity": heterogeneity,
        "step_s": step_s,
        "parameters": params,
        "real_wall_s": res.wall_s,
        "codec": codec,
        "curve": {"steps": res.steps, "val_loss": res.val_loss, "sim_time_s": res.curve_times(done)},
    }
    if plot:
        write_plot(plot, [out])
    if not quiet:
        console.print(
            f"{out['algo']} x{workers}: val {out['final_val_loss']:.4f} nats/byte "
            f"(from {out['initial_val_loss']:.3f}), {out['bytes_sent_per_worker'] / 1e6:.2f} MB sent "
            f"per worker, simulated {wall:.2f} s, compute utilisation {100 * sum(util) / len(util):.1f}% "
            f"mean, {100 * min(util):.1f}% min"
        )
    return out


def write_plot(path: Path, runs: list[dict[str, Any]]) -> None:
    """Validation loss against inner step and against simulated time, one line per run."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        label = f"{run['algo']} x{run['workers']}"
        ax1.plot(run["curve"]["steps"], run["curve"]["val_loss"], marker=".", label=label)
        ax2.plot(run["curve"]["sim_time_s"], run["curve"]["val_loss"], marker=".", label=label)
    ax1.set_xlabel("inner step")
    ax2.set_xlabel("simulated time (s)")
    for ax in (ax1, ax2):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    from locomm.atomic import atomic_path  # noqa: PLC0415

    with atomic_path(Path(path)) as tmp:  # the temp name ends in .tmp: the format is given
        fig.savefig(tmp, dpi=100, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)

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


@cli.command()
@click.option(
    "--algo",
    type=click.Choice(["ddp", "diloco", "noloco", "gasloc", "sparseloco"]),
    help="Outer algorithm (required, except with --pipeline: replica sync, default noloco).",
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
@click.option("--seed", type=int, help="Overrides train.seed (model init and data order).")
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
            as_json,
        )
        return
    try:
        if algo is None:
            raise ConfigError("--algo is required (or give --pipeline SxR)")
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
    as_json: bool,
) -> None:
    try:
        from locomm.sim.network import parse_link  # noqa: PLC0415 - numpy only

        stages, replicas = _parse_pipeline(shape)
        spec = load_spec(config, preset or (None if config else "nano"))
        spec = spec.replace("pipeline", stages=stages, **({"subspace": False} if no_subspace else {}))
        spec = spec.replace(
            "outer",
            algo=algo or (spec.outer.algo if spec.outer.algo != "none" else "noloco"),
            **({"inner_steps": inner_steps} if inner_steps is not None else {}),
        )
        if seed is not None:
            spec = spec.replace("train", seed=seed)
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


def _parse_pipeline(text: str) -> tuple[int, int]:
    try:
        s, r = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--pipeline: expected STAGESxREPLICAS such as 2x2, got {text!r}") from None
    if s < 2 or not 1 <= r <= 16:
        raise ConfigError(f"--pipeline: need at least 2 stages and 1-16 replicas, got {text!r}")
    return s, r


@cli.command()
@click.option(
    "--initial-peers", multiple=True, help="Multiaddr of a peer in the swarm (repeatable). None: start a new swarm."
)
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    help="Run spec (TOML). A joiner refuses a swarm whose spec differs; without it, a joiner takes the swarm's spec.",
)
@click.option("--preset", type=PRESETS, help="Model preset of a new swarm (default nano).")
@click.option(
    "--algo",
    type=click.Choice(["noloco", "gasloc", "sparseloco", "diloco"]),
    help="Outer algorithm of a new swarm (diloco: over hivemind's DecentralizedAverager).",
)
@click.option("--inner-steps", type=int, help="H of a new swarm.")
@click.option(
    "--host-maddrs",
    multiple=True,
    default=["/ip4/127.0.0.1/tcp/0"],
    show_default=True,
    help="Where p2pd listens; /ip4/0.0.0.0/tcp/31337 to accept peers from other machines.",
)
@click.option("--announce-maddrs", multiple=True, help="Addresses others should dial (behind NAT/port forward).")
@click.option("--identity", type=click.Path(dir_okay=False, path_type=Path), help="Private key file: a stable peer id.")
@click.option("--device", default=lambda: os.environ.get("LOCOMM_DEVICE", "auto"), show_default="auto")
@click.option(
    "--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), help="Checkpoint here and resume from it."
)
@click.option(
    "--checkpoint-every",
    type=int,
    default=5,
    show_default=True,
    help="Rounds between checkpoints (one is also written at shutdown).",
)
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on METRICS_HOST:PORT (0: any free port).")
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics server binds; 0.0.0.0: every interface (a container's published port).",
)
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path), help="JSON-lines event log.")
@click.option("--rounds", type=int, help="Stop after this many rounds.")
@click.option("--shard", help="Data shard as INDEX/COUNT (default: from the peer id).")
@click.option("--no-overlap", is_flag=True, help="Apply each exchange before the next inner step.")
@click.option("--announce-file", type=click.Path(dir_okay=False, path_type=Path), hidden=True)
@click.option("--final-weights", type=click.Path(dir_okay=False, path_type=Path), hidden=True)
@click.option("--until-round", type=int, hidden=True)
@click.option("--wait-for-peers", type=int, default=0, help="Before training, wait up to a minute for N peers.")
@click.option(
    "--stage",
    help="Pipeline mode: serve stage K of the model, or 'auto' (the stage with the fewest "
    "live replicas). The run spec needs pipeline.stages >= 2.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
@click.option("-q", "--quiet", is_flag=True, help="No status line, per-round lines or summary (log lines stay).")
@click.option("-v", "--verbose", count=True)
def join(
    initial_peers: tuple[str, ...],
    config: str | None,
    preset: str | None,
    algo: str | None,
    inner_steps: int | None,
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: Path | None,
    device: str,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    metrics_port: int | None,
    metrics_host: str,
    log_file: Path | None,
    rounds: int | None,
    shard: str | None,
    no_overlap: bool,
    announce_file: Path | None,
    final_weights: Path | None,
    until_round: int | None,
    wait_for_peers: int,
    stage: str | None,
    as_json: bool,
    quiet: bool,
    verbose: int,
) -> None:
    """Join a training swarm (or start one) and train until the run ends or Ctrl-C.

    On a terminal a live line shows the round, loss, speed, traffic and the transfer in progress; without
    one (a log, a container) one plain line per round. A summary paragraph follows at exit. All of it goes
    to stderr (stdout keeps the --json line); -q silences it.
    """
    try:
        spec = load_spec(config, preset or (None if config else "nano"))
        if not config:
            spec = spec.replace(
                "outer", algo=algo or "noloco", **({"inner_steps": inner_steps} if inner_steps is not None else {})
            )
        elif algo or inner_steps:
            raise ConfigError("--algo/--inner-steps set the spec of a new swarm; put them in --config instead")
        shard_t = _parse_shard(shard) if shard else None
        if stage is not None and stage != "auto" and not (stage.isdigit() and int(stage) >= 0):
            raise ConfigError(f"--stage: expected a stage number or 'auto', got {stage!r}")
        if rounds is not None and rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        if checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every: must be >= 1, got {checkpoint_every}")
    except ConfigError as e:
        fail(str(e))
    from locomm.cli.daemon import run_node  # noqa: PLC0415 - imports torch and hivemind

    summary = run_node(
        spec,
        initial_peers=initial_peers,
        spec_from_user=bool(config),
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        identity=identity,
        device=device,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        log_file=log_file,
        rounds=rounds,
        shard=shard_t,
        overlap=not no_overlap,
        announce_file=announce_file,
        final_weights=final_weights,
        until_round=until_round,
        wait_for_peers=wait_for_peers,
        verbose=verbose,
        quiet=quiet,
        **({"stage": stage} if stage is not None else {}),
    )
    if as_json:
        emit_json(summary)


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard: expected INDEX/COUNT, got {text!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"--shard: index {i} not in [0, {n})")
    return i, n


@cli.command()
@click.option("--peers", type=int, default=3, show_default=True, help="Peer processes to start on loopback.")
@click.option("--rounds", type=int, default=5, show_default=True, help="Outer rounds each peer trains.")
@click.option(
    "--algo", type=click.Choice(["noloco", "gasloc", "sparseloco", "diloco"]), default="noloco", show_default=True
)
@click.option("--inner-steps", type=int, help="H (default: the preset's, 50).")
@click.option("--preset", type=PRESETS, help="Model preset (default nano).")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Run spec (TOML).")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("locomm-swarm.png"),
    show_default=True,
    help="Loss plot written at the end.",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    help="Copy the peers' logs, checkpoints and final weights here.",
)
@click.option(
    "--pipeline",
    "pipeline_shape",
    help="STAGESxREPLICAS, e.g. 2x2: pipeline mode, one peer per "
    "stage replica (--peers is ignored); --rounds x --inner-steps optimizer steps.",
)
@click.option("--no-subspace", is_flag=True, help="With --pipeline: send activations uncompressed (comparison).")
@click.option("--kill-at-step", type=int, hidden=True, help="With --pipeline: SIGKILL a stage-1 replica here.")
@click.option("--join-auto-at-step", type=int, hidden=True, help="With --pipeline: start a --stage auto joiner.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
def swarm(
    peers: int,
    rounds: int,
    algo: str,
    inner_steps: int | None,
    preset: str | None,
    config: str | None,
    plot: Path,
    keep: Path | None,
    pipeline_shape: str | None,
    no_subspace: bool,
    kill_at_step: int | None,
    join_auto_at_step: int | None,
    as_json: bool,
) -> None:
    """Start a local swarm of real peers on loopback and train it."""
    if pipeline_shape is not None:
        try:
            stages, replicas = _parse_pipeline(pipeline_shape)
            if rounds < 1:
                raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
            spec = load_spec(config, preset or (None if config else "nano"))
            spec = spec.replace("outer", algo=algo, **({"inner_steps": inner_steps} if inner_steps else {}))
            spec = spec.replace("pipeline", stages=stages, **({"subspace": False} if no_subspace else {}))
            spec = spec.replace("train", steps=rounds * spec.outer.inner_steps)
        except ConfigError as e:
            fail(str(e))
        from locomm.cli.pipeline_swarm import run_pipeline_swarm  # noqa: PLC0415

        summary = run_pipeline_swarm(
            spec,
            stages=stages,
            replicas=replicas,
            quiet=as_json,
            keep=keep,
            kill_at_step=kill_at_step,
            join_auto_at_step=join_auto_at_step,
        )
        if as_json:
            emit_json(summary)
        if summary["failed_peers"]:
            sys.exit(1)
        return
    try:
        if not 2 <= peers <= 32:
            raise ConfigError(f"--peers: must be in [2, 32], got {peers}")
        if rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        spec = load_spec(config, preset or (None if config else "nano"))
        spec = spec.replace("outer", algo=algo, **({"inner_steps": inner_steps} if inner_steps is not None else {}))
        if rounds * spec.outer.inner_steps > spec.train.steps:  # the LR schedule spans the whole run
            spec = spec.replace("train", steps=rounds * spec.outer.inner_steps)
    except ConfigError as e:
        fail(str(e))
    from locomm.cli.local_swarm import run_swarm  # noqa: PLC0415

    summary = run_swarm(spec, peers=peers, rounds=rounds, quiet=as_json, plot=plot, keep=keep)
    if as_json:
        emit_json(summary)
    if summary["failed_peers"]:
        sys.exit(1)


@cli.command()
@click.option("--initial-peers", multiple=True, required=True, help="Multiaddr of any peer in the swarm.")
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print the swarm as one JSON object.")
def status(initial_peers: tuple[str, ...], watch: bool, as_json: bool) -> None:
    """Show a running swarm from its DHT records: peers, rounds, loss, throughput, traffic."""
    from locomm.cli.status import show_status  # noqa: PLC0415

    show_status(list(initial_peers), watch=watch, as_json=as_json)


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

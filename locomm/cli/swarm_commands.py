"""``locomm-peer join``, ``swarm`` and ``status``: the commands that talk to a swarm of real peers.

``join`` runs one peer (the daemon, :mod:`locomm.cli.daemon`); ``swarm`` starts a local swarm of peer
processes on loopback (:mod:`locomm.cli.local_swarm`), data-parallel or ``--pipeline SxR``; ``status``
reads a running swarm from its DHT records. Torch and hivemind are imported inside each command.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from locomm.cli.options import (
    PRESETS,
    MemorySize,
    check_swarm_id,
    check_swarm_key,
    emit_json,
    fail,
    listen_addrs,
    listen_options,
    load_spec,
    parse_islands,
    parse_pipeline,
    parse_shard,
    swarm_key_option,
)
from locomm.config import ConfigError


@click.command()
@click.option("--initial-peers", multiple=True, help="Multiaddr of a peer in the swarm (repeatable).")
@click.option(
    "--new-swarm",
    is_flag=True,
    help="Start a new swarm (no --initial-peers): say so, so that a missing "
    "--initial-peers is an error, not a swarm of one.",
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
@listen_options
@click.option(
    "--no-relay",
    is_flag=True,
    help="Neither serve as a libp2p circuit relay for NATed peers nor reach peers through one.",
)
@click.option("--no-auto-relay", is_flag=True, help="Behind NAT, do not reserve a relay slot (nobody can dial us).")
@click.option("--relay", "relays", multiple=True, help="Relay multiaddr (with /p2p/ID) to reserve on (repeatable).")
@click.option(
    "--reachability",
    type=click.Choice(["auto", "public", "private"]),
    default="auto",
    show_default=True,
    help="private: we are behind NAT (use a relay at once); auto: AutoNAT finds out.",
)
@click.option("--averager-port", type=int, default=0, help="DiLoCo: TCP port of the averager's p2pd (0: any).")
@click.option(
    "--identity",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Private key file (RSA, created when missing): a stable peer id; it signs this peer's DHT records.",
)
@swarm_key_option
@click.option(
    "--swarm",
    "swarm_id",
    help="The founder's swarm id (admit --new-founder prints it): take the spec its members store, through any "
    "--initial-peers DHT node; needs your certificate of that swarm as --swarm-key.",
)
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
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="The log lines on stderr: text, or one JSON object a line (for log collectors).",
)
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write TensorBoard scalars of every round here, under <run id>/<peer id> (extra: locomm[trackers]).",
)
@click.option(
    "--wandb",
    "wandb_project",
    help="Log every round to this W&B project, grouped by the swarm's run id "
    "(extra: locomm[trackers]; WANDB_MODE=offline keeps it local).",
)
@click.option("--rounds", type=int, help="Stop after this many rounds.")
@click.option("--shard", help="Data shard as INDEX/COUNT (default: from the peer id).")
@click.option("--no-overlap", is_flag=True, help="Apply each exchange before the next inner step.")
@click.option("--announce-file", type=click.Path(dir_okay=False, path_type=Path), hidden=True)
@click.option("--final-weights", type=click.Path(dir_okay=False, path_type=Path), hidden=True)
@click.option("--until-round", type=int, hidden=True)
@click.option("--attack", hidden=True, help="Benchmarks only: this peer lies (protocol/attacks.py ATTACKS).")
@click.option("--wait-for-peers", type=int, default=0, help="Before training, wait up to a minute for N peers.")
@click.option(
    "--stage",
    help="Pipeline mode: serve stage K of the model, or 'auto' (the stage with the fewest "
    "live replicas). The run spec needs pipeline.stages >= 2.",
)
@click.option(
    "--max-memory",
    type=MemorySize(),
    help="Memory the inner step may use, e.g. 8GiB, 8GB, 512MiB (a bare number: GiB; default: the device's "
    "free memory); picks micro-batch and accumulation.",
)
@click.option("--plan", "plan_only", is_flag=True, help="Print the memory plan for --max-memory and exit.")
@click.option("--max-upload-mbit", type=float, help="Cap this peer's upload (all streams and services).")
@click.option("--max-download-mbit", type=float, help="Cap this peer's download (all streams and services).")
@click.option("--eval-every", type=int, help="Rounds between validation evaluations (0: start and end only).")
@click.option(
    "--island",
    help="Train with the peers of this island name as one worker, SCAPE every step (a fast link between them).",
)
@click.option("--island-size", type=int, default=2, show_default=True, help="How many peers the island has.")
@click.option(
    "--island-key",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Close the island: a secret (>= 32 random bytes) or a list of peer ids, as --swarm-key.",
)
@click.option(
    "--resume-from",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Restart a stopped swarm from this checkpoint folder: its spec and round (and checkpoint here).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary as the last stdout line.")
@click.option("-q", "--quiet", is_flag=True, help="No status line, per-round lines or summary (log lines stay).")
@click.option("-v", "--verbose", count=True)
def join(
    initial_peers: tuple[str, ...],
    new_swarm: bool,
    config: str | None,
    preset: str | None,
    algo: str | None,
    inner_steps: int | None,
    host_maddrs: tuple[str, ...],
    port: int,
    public_ip: str | None,
    announce_maddrs: tuple[str, ...],
    no_relay: bool,
    no_auto_relay: bool,
    relays: tuple[str, ...],
    reachability: str,
    averager_port: int,
    identity: Path | None,
    swarm_key: Path | None,
    swarm_id: str | None,
    device: str,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    metrics_port: int | None,
    metrics_host: str,
    log_file: Path | None,
    log_format: str,
    tensorboard: Path | None,
    wandb_project: str | None,
    rounds: int | None,
    shard: str | None,
    no_overlap: bool,
    announce_file: Path | None,
    final_weights: Path | None,
    until_round: int | None,
    attack: str | None,
    wait_for_peers: int,
    stage: str | None,
    max_memory: float | None,
    plan_only: bool,
    max_upload_mbit: float | None,
    max_download_mbit: float | None,
    eval_every: int | None,
    island: str | None,
    island_size: int,
    island_key: Path | None,
    resume_from: Path | None,
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
        if not initial_peers and not new_swarm and resume_from is None and not plan_only:
            raise ConfigError(
                "no swarm to join: pass --initial-peers MULTIADDR (a peer's address, as it prints it), "
                "or --new-swarm to start one"
            )
        if initial_peers and new_swarm:
            raise ConfigError("--new-swarm starts a swarm; --initial-peers joins one: give one of them")
        host_maddrs, announce_maddrs = listen_addrs(host_maddrs, port, public_ip, announce_maddrs)
        spec = load_spec(config, preset)
        if not config:
            spec = spec.replace(
                "outer", algo=algo or "noloco", **({"inner_steps": inner_steps} if inner_steps is not None else {})
            )
        elif algo or inner_steps:
            raise ConfigError("--algo/--inner-steps set the spec of a new swarm; put them in --config instead")
        shard_t = parse_shard(shard) if shard else None
        if stage is not None and stage != "auto" and not (stage.isdigit() and int(stage) >= 0):
            raise ConfigError(f"--stage: expected a stage number or 'auto', got {stage!r}")
        if rounds is not None and rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        if checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every: must be >= 1, got {checkpoint_every}")
        swarm_key = check_swarm_key(swarm_key)
        if swarm_id is not None:
            check_swarm_id(swarm_id, swarm_key)
        for name, v in (("memory", max_memory), ("upload-mbit", max_upload_mbit), ("download-mbit", max_download_mbit)):
            if v is not None and not v > 0:
                raise ConfigError(f"--max-{name}: must be > 0, got {v}")
        if eval_every is not None and eval_every < 0:
            raise ConfigError(f"--eval-every: must be >= 0, got {eval_every}")
        if island_key is not None:
            if island is None:
                raise ConfigError("--island-key closes an island: give --island NAME too")
            from locomm.peer.transport.records import SwarmKey  # noqa: PLC0415 - imports hivemind

            SwarmKey.load(island_key)  # a bad file fails here, in one line
        if island is not None and (stage is not None or not 2 <= island_size <= 64 or not 0 < len(island) <= 64):
            raise ConfigError("--island: a name of 1-64 characters, --island-size in [2, 64], and no --stage")
        if resume_from is not None:
            if initial_peers:
                raise ConfigError("--resume-from restarts a stopped swarm; to rejoin a running one, drop it")
            from locomm.checkpoint import checkpoint_spec  # noqa: PLC0415 - imports torch

            spec = checkpoint_spec(resume_from, spec if config else None)
            if checkpoint_dir is not None and checkpoint_dir.resolve() != resume_from.resolve():
                raise ConfigError("--resume-from DIR resumes and checkpoints in DIR; drop --checkpoint-dir")
            checkpoint_dir = resume_from
        if checkpoint_dir is not None:
            from locomm.peer.control import control_path  # noqa: PLC0415 - a too long folder fails here, not later

            control_path(checkpoint_dir)
        if attack is not None:
            from locomm.protocol.attacks import ATTACKS  # noqa: PLC0415 - imports torch

            if attack not in ATTACKS:
                raise ConfigError(f"--attack: one of {', '.join(ATTACKS)}; got {attack!r}")
        if plan_only:
            from locomm.train import peer_plan, resolve_device  # noqa: PLC0415 - imports torch

            if initial_peers and not config:  # the swarm's own batch and model, signed by the peers it names
                import asyncio  # noqa: PLC0415

                from locomm.cli.status import swarm_spec_toml  # noqa: PLC0415 - imports hivemind
                from locomm.config import RunSpec  # noqa: PLC0415

                try:
                    toml = asyncio.run(asyncio.wait_for(swarm_spec_toml(list(initial_peers), swarm_key), 90))
                except ConfigError:
                    raise
                except Exception as e:  # noqa: BLE001 - p2pd and the DHT fail in many ways: one line, no traceback
                    raise ConfigError(f"--plan: cannot read the swarm's spec: {type(e).__name__}: {e}") from None
                spec = RunSpec.from_toml(toml)

            try:
                dev = resolve_device(device)
            except ValueError as e:  # with --max-memory a plan is arithmetic: a CUDA plan on a machine without one
                if max_memory is None:
                    raise ConfigError(f"{e}; pass --max-memory to plan for a device this machine lacks") from None
                dev = device
            plan = peer_plan(spec, device=dev, max_memory_gb=max_memory)
            if plan is None:
                raise ConfigError(f"--plan: no free-memory reading for device {device}; pass --max-memory")
            if as_json:
                emit_json(plan.as_json())
            else:
                click.echo(plan.describe())
            return
    except ConfigError as e:
        fail(str(e))
    from locomm.cli.daemon import run_node  # noqa: PLC0415 - imports torch and hivemind

    summary = run_node(
        spec,
        initial_peers=initial_peers,
        spec_from_user=bool(config) or resume_from is not None,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        relay=not no_relay,
        auto_relay=not no_auto_relay,
        relays=relays,
        reachability=None if reachability == "auto" else reachability,
        averager_port=averager_port,
        identity=identity,
        swarm_key=swarm_key,
        swarm_id=swarm_id,
        device=device,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        log_file=log_file,
        log_format=log_format,
        tensorboard=tensorboard,
        wandb=wandb_project,
        rounds=rounds,
        shard=shard_t,
        overlap=not no_overlap,
        announce_file=announce_file,
        final_weights=final_weights,
        until_round=until_round,
        attack=attack,
        wait_for_peers=wait_for_peers,
        max_memory_gb=max_memory,
        max_upload_mbit=max_upload_mbit,
        max_download_mbit=max_download_mbit,
        eval_every=eval_every,
        island=island,
        island_size=island_size,
        island_key=island_key,
        island_digest=os.environ.get("LOCOMM_ISLAND_DIGEST") == "1",
        verbose=verbose,
        quiet=quiet,
        **({"stage": stage} if stage is not None else {}),
    )
    if as_json:
        emit_json(summary)


@click.command()
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
@click.option(
    "--islands",
    "islands_shape",
    help="ISLANDSxSIZE, e.g. 2x2: the first ISLANDS*SIZE peers form islands of SIZE peers (SCAPE every step, "
    "AdamS inside), joined by the outer algorithm; --peers grows to cover them.",
)
@click.option("--no-subspace", is_flag=True, help="With --pipeline: send activations uncompressed (comparison).")
@click.option("--kill-at-step", type=int, hidden=True, help="With --pipeline: SIGKILL a stage-1 replica here.")
@click.option("--join-auto-at-step", type=int, hidden=True, help="With --pipeline: start a --stage auto joiner.")
@click.option(
    "--eval-every", type=int, default=1, show_default=True, help="Rounds between validation evaluations (0: ends)."
)
@swarm_key_option
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
    islands_shape: str | None,
    no_subspace: bool,
    kill_at_step: int | None,
    join_auto_at_step: int | None,
    eval_every: int,
    swarm_key: Path | None,
    as_json: bool,
) -> None:
    """Start a local swarm of real peers on loopback and train it (a closed one with --swarm-key)."""
    try:
        key = check_swarm_key(swarm_key)
        if eval_every < 0:
            raise ConfigError(f"--eval-every: must be >= 0, got {eval_every}")
    except ConfigError as e:
        fail(str(e))
    peer_args = ("--swarm-key", str(key)) if key is not None else ()
    if pipeline_shape is not None:
        try:
            stages, replicas = parse_pipeline(pipeline_shape)
            if rounds < 1:
                raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
            spec = load_spec(config, preset)
            spec = spec.replace("outer", algo=algo, **({"inner_steps": inner_steps} if inner_steps else {}))
            spec = spec.replace("pipeline", stages=stages, **({"subspace": False} if no_subspace else {}))
            spec = spec.replace("train", steps=rounds * spec.outer.inner_steps)
        except ConfigError as e:
            fail(str(e))
        from locomm.cli.local_swarm import run_pipeline_swarm  # noqa: PLC0415

        summary = run_pipeline_swarm(
            spec,
            stages=stages,
            replicas=replicas,
            quiet=as_json,
            keep=keep,
            kill_at_step=kill_at_step,
            join_auto_at_step=join_auto_at_step,
            peer_args=peer_args,
            eval_every=eval_every,
            plot=plot,
        )
        if as_json:
            emit_json(summary)
        if summary["failed_peers"]:
            sys.exit(1)
        return
    try:
        islands = parse_islands(islands_shape) if islands_shape is not None else None
        if islands is not None:
            peers = max(peers, islands[0] * islands[1])
        if not 2 <= peers <= 32:
            raise ConfigError(f"--peers: must be in [2, 32], got {peers}")
        if rounds < 1:
            raise ConfigError(f"--rounds: must be >= 1, got {rounds}")
        spec = load_spec(config, preset)
        spec = spec.replace("outer", algo=algo, **({"inner_steps": inner_steps} if inner_steps is not None else {}))
        if rounds * spec.outer.inner_steps > spec.train.steps:  # the LR schedule spans the whole run
            spec = spec.replace("train", steps=rounds * spec.outer.inner_steps)
        if islands is not None and spec.inner.name != "adams":  # SCAPE's masks come from AdamS's first moment
            spec = spec.replace("inner", name="adams")
    except ConfigError as e:
        fail(str(e))
    from locomm.cli.local_swarm import run_swarm  # noqa: PLC0415

    summary = run_swarm(
        spec,
        peers=peers,
        rounds=rounds,
        quiet=as_json,
        plot=plot,
        keep=keep,
        peer_args=peer_args,
        eval_every=eval_every,
        islands=islands,
    )
    if as_json:
        emit_json(summary)
    if summary["failed_peers"]:
        sys.exit(1)


@click.command()
@click.option(
    "--initial-peers",
    multiple=True,
    required=True,
    help="Multiaddr of a peer in the swarm, ending in /p2p/<peer id> (the spec that peer signed is read).",
)
@swarm_key_option
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print the swarm as one JSON object.")
@click.option(
    "--serve",
    "serve_port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve the swarm as a web page on this port (0: any free one): the peers table and each peer's loss "
    "over time, refreshed every 2 s from one DHT client; the same data at /status.json. Until Ctrl-C.",
)
@click.option("--serve-host", default="127.0.0.1", show_default=True, help="With --serve: the address to listen on.")
def status(
    initial_peers: tuple[str, ...],
    swarm_key: Path | None,
    watch: bool,
    as_json: bool,
    serve_port: int | None,
    serve_host: str,
) -> None:
    """Show a running swarm from its signed DHT records: peers, rounds, loss, throughput, traffic."""
    try:
        key = check_swarm_key(swarm_key)
    except ConfigError as e:
        fail(str(e))
    if serve_port is not None:
        if watch or as_json:
            fail("--serve runs a page until Ctrl-C: drop --watch and --json (the page serves /status.json)")
        from locomm.cli.status import unnamed  # noqa: PLC0415
        from locomm.cli.status_page import serve_status  # noqa: PLC0415

        if (error := unnamed(list(initial_peers))) is not None:
            fail(error)
        serve_status(list(initial_peers), host=serve_host, port=serve_port, swarm_key=key)
        return
    from locomm.cli.status import show_status  # noqa: PLC0415

    show_status(list(initial_peers), watch=watch, as_json=as_json, swarm_key=key)

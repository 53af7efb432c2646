"""``locomm-peer``: the command line. Thin: parse, load the run spec, call into the package.

One module per command group: :mod:`locomm.cli.local_commands` (``train``, ``simulate``: this machine
alone) and :mod:`locomm.cli.swarm_commands` (``join``, ``swarm``, ``status``: real peers); what they share
(the run spec from flags, one-line errors, the JSON line) is :mod:`locomm.cli.options`.

Heavy imports (torch, hivemind) happen inside the commands, so ``--help`` is instant.
Errors a user can fix (bad config, missing corpus, bad checkpoint) print one line
and exit with status 2, never a traceback.
"""

from __future__ import annotations

import click

from locomm import __version__
from locomm.cli.admit import admit
from locomm.cli.bootstrap import bootstrap
from locomm.cli.control import pause, resume
from locomm.cli.doctor import doctor
from locomm.cli.local_commands import simulate, train
from locomm.cli.model_commands import eval_command, export, generate
from locomm.cli.options import PRESETS, emit_json, fail, load_spec
from locomm.cli.plot import plot
from locomm.cli.swarm_commands import join, status, swarm

__all__ = [
    "PRESETS",
    "admit",
    "bench",
    "bootstrap",
    "cli",
    "doctor",
    "emit_json",
    "fail",
    "join",
    "load_spec",
    "main",
    "pause",
    "plot",
    "resume",
    "simulate",
    "status",
    "swarm",
    "train",
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="locomm-peer")
def cli() -> None:
    """locomm: train a language model across peers on consumer links."""


for _command in (
    train,
    simulate,
    join,
    swarm,
    status,
    bootstrap,
    doctor,
    pause,
    resume,
    plot,
    export,
    generate,
    eval_command,
    admit,
):
    cli.add_command(_command)


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

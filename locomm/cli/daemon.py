"""Process-level entry for a node: logging, the reporter, uvloop, the event loop, exit codes."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from locomm.cli.display import make_reporter
from locomm.config import ConfigError, RunSpec
from locomm.data import CorpusError
from locomm.peer import lifeline
from locomm.peer.dataparallel.node import Node
from locomm.peer.options import NodeOptions
from locomm.peer.transport.reach import Stopped


class JsonLines(logging.Formatter):
    """One JSON object a line (time, level, logger, message; the traceback when there is one), for log
    collectors that read JSON, beside the event log (``--log-file``)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": record.created, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(verbose: int, log_format: str = "text") -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(JsonLines() if log_format == "json" else plain)
    ours = logging.getLogger("locomm")
    ours.handlers[:] = [handler]
    ours.setLevel(level)
    ours.propagate = False  # hivemind configures the root logger too; print our lines once
    if verbose < 2:  # hivemind is chatty at INFO
        logging.getLogger("hivemind").setLevel(logging.WARNING)


def run_node(
    spec: RunSpec, *, verbose: int = 0, quiet: bool = False, reporter: Any = None, **options: Any
) -> dict[str, Any]:
    """Run one node to completion in a fresh event loop (uvloop when installed).

    ``reporter`` shows the user what the node does (locomm.cli.display); by default a live line on a
    terminal, plain lines per round otherwise, nothing with ``quiet``. It goes to stderr: stdout stays free
    for ``--json``. ``reporter.close()`` runs whatever happens (it restores the terminal).
    """
    setup_logging(verbose, options.pop("log_format", "text"))  # -q keeps the log lines: it silences the reporter only
    lifeline.install()  # p2pd and DiLoCo's forked helpers die with this process, even SIGKILLed
    stage = options.pop("stage", None)
    if reporter is None:
        reporter = make_reporter(quiet=quiet or stage is not None)  # pipeline mode: the event log, no live line
    try:
        try:
            if stage is not None:  # pipeline mode: serve one stage (locomm/peer/pipeline/stage.py)
                from locomm.peer.pipeline.stage import Stage  # noqa: PLC0415

                node = Stage(spec, NodeOptions(reporter=reporter, **options), stage=stage)
            else:
                opts = NodeOptions(reporter=reporter, **options)
                island = None
                if opts.island is not None:  # an island member (locomm/peer/island/member.py)
                    from locomm.peer.island.member import Island as island  # noqa: PLC0415, N813

                node = Node(spec, opts, island=island)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        try:
            import uvloop  # noqa: PLC0415

            runner: Any = uvloop.run
        except ImportError:
            runner = asyncio.run
        try:
            summary = runner(node.run())
        except (ConfigError, CorpusError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except Stopped as e:
            print(f"{e}: nothing was trained, nothing to hand over", file=sys.stderr)
            sys.exit(0)
        if getattr(reporter, "finished", True) is False:  # our reporters: the node did not call finish()
            reporter.finish(summary)
        return summary
    finally:
        reporter.close()

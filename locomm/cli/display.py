"""What ``locomm-peer join`` shows its user: a live status line, one line per round, a summary at exit.

The node calls a reporter (``NodeOptions.reporter``) with plain dicts:

* ``update(status)`` about twice a second, from the node's asyncio loop thread: it only stores the
  dict (the live line is drawn by rich's refresh thread), so it is cheap and never blocks;
* ``round_done(status)`` after each round;
* ``finish(summary)`` once at exit;
* ``close()`` always, at the very end (also after errors): it restores the terminal.

Every key of every dict may be missing, None or NaN; no method raises.

The words and numbers themselves (``round_line``, ``summary_paragraph``, ``fmt_*``) are
:mod:`locomm.cli.formatting`, re-exported here.

``make_reporter`` picks one of three: nothing (``-q``), a rich live line on a terminal, or one plain
line per round for logs and containers (stderr not a TTY). The JSON-lines event log is not touched here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Mapping
from typing import IO, Any, Protocol

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from locomm.cli.formatting import (
    _count,
    _int,
    _num,
    _pick_transfer,
    _plural,
    _round_text,
    fmt_bytes,
    fmt_duration,
    fmt_eta,
    fmt_loss,
    fmt_rate,
    round_line,
    summary_paragraph,
    transfer_text,
)

__all__ = [
    "JoinReporter",
    "LiveReporter",
    "NullReporter",
    "PlainReporter",
    "fmt_bytes",
    "fmt_duration",
    "fmt_eta",
    "fmt_loss",
    "fmt_rate",
    "make_reporter",
    "round_line",
    "summary_paragraph",
    "transfer_text",
]


class JoinReporter(Protocol):
    def update(self, status: dict) -> None: ...
    def round_done(self, status: dict) -> None: ...
    def finish(self, summary: dict) -> None: ...
    def close(self) -> None: ...


def make_reporter(
    *, quiet: bool, stream: IO[str] | None = None, console: Console | None = None, live: bool | None = None
) -> NullReporter | PlainReporter | LiveReporter:
    """The reporter for ``join``: a no-op when ``quiet``; a live line when the output (``stream``, default
    stderr) is a terminal; else plain lines. ``live`` forces the choice, ``console`` the rich console."""
    if quiet:
        return NullReporter()
    if live is None and console is None:  # a real TTY: FORCE_COLOR in a CI log must not make it live
        live = _isatty(stream if stream is not None else sys.stderr)
    if console is None:
        console = Console(file=stream) if stream is not None else Console(stderr=True)
    if live is None:
        live = console.is_terminal
    live = live and not console.is_dumb_terminal
    if live:
        return LiveReporter(console)
    return PlainReporter(stream if stream is not None else console.file)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # noqa: BLE001 - closed, detached or not a file
        return False


# -- reporters ------------------------------------------------------------------------------------------


class NullReporter:
    """``-q``: shows nothing."""

    finished = False

    def update(self, status: dict) -> None:
        pass

    def round_done(self, status: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        self.finished = True

    def close(self) -> None:
        pass


class PlainReporter:
    """No terminal (a log file, a container): one plain line per round, then the summary, on ``stream``."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream
        self.last: dict = {}
        self.finished = False

    def _write(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a closed or broken stream must not stop training
            out = self.stream if self.stream is not None else sys.stderr
            out.write(line + "\n")
            out.flush()

    def update(self, status: dict) -> None:
        if isinstance(status, dict):
            self.last = status

    def round_done(self, status: dict) -> None:
        with contextlib.suppress(Exception):
            if isinstance(status, dict):
                self.last = status
                self._write(round_line(status))

    def finish(self, summary: dict) -> None:
        if self.finished:
            return
        self.finished = True
        with contextlib.suppress(Exception):
            self._write(summary_paragraph(summary if isinstance(summary, Mapping) else {}, self.last))

    def close(self) -> None:
        pass


class _ConsoleHandler(logging.Handler):
    """Prints log records through the rich console (above the live line), formatted as the handler it stands in
    for formatted them (ANSI colours included)."""

    def __init__(self, console: Console, like: logging.Handler) -> None:
        super().__init__(like.level)
        self.console = console
        self.setFormatter(like.formatter or logging.Formatter())
        for f in like.filters:
            self.addFilter(f)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(Text.from_ansi(self.format(record)), soft_wrap=True, highlight=False)
        except Exception:  # noqa: BLE001
            self.handleError(record)


class _Line:
    def __init__(self, reporter: LiveReporter) -> None:
        self.reporter = reporter

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        try:
            text = self.reporter.render_line(console.get_time(), options.max_width)
        except Exception as e:  # noqa: BLE001 - never kill rich's refresh thread
            text = Text(f"locomm: (status unavailable: {type(e).__name__})")
        text.no_wrap = True
        text.overflow = "ellipsis"
        yield text


class LiveReporter:
    """A terminal: one live line (rich), redrawn a few times a second; a plain line above it per round;
    the summary at exit. Log records written to the terminal go through the console, above the line."""

    SEP = " · "

    def __init__(
        self,
        console: Console | None = None,
        *,
        refresh_per_second: float = 4,
        auto_refresh: bool = True,
        loggers: Iterable[str] = ("", "locomm", "hivemind"),
    ) -> None:
        self.console = console if console is not None else Console(stderr=True)
        self.auto_refresh = auto_refresh
        self.refresh_per_second = refresh_per_second
        self.loggers = tuple(loggers)
        self.last: dict = {}
        self.finished = False
        self.closed = False
        self.live: Live | None = None
        self.spinner = Spinner("dots", style="cyan")
        self.t0 = time.monotonic()
        self._swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []

    # live display lifecycle

    def _start(self) -> None:
        if self.live is not None or self.closed or self.finished:
            return
        live = Live(
            console=self.console,
            get_renderable=lambda: _Line(self),
            auto_refresh=self.auto_refresh,
            refresh_per_second=self.refresh_per_second,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=True,
        )
        self.live = live
        try:
            self._route_logs()
            live.start()
        except Exception:  # noqa: BLE001 - e.g. another Live already active on this console
            self.live = None
            self._restore_logs()

    def _stop(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            with contextlib.suppress(Exception):
                live.stop()
        self._restore_logs()

    def _route_logs(self) -> None:
        """Swap each plain StreamHandler writing to our terminal for one printing through the console."""
        targets = {id(s) for s in (self.console.file, sys.stderr, sys.__stderr__) if s is not None}
        for name in self.loggers:
            logger = logging.getLogger(name)
            for h in list(logger.handlers):
                if type(h) is logging.StreamHandler and id(h.stream) in targets:
                    repl = _ConsoleHandler(self.console, h)
                    logger.removeHandler(h)
                    logger.addHandler(repl)
                    self._swapped.append((logger, h, repl))

    def _restore_logs(self) -> None:
        swapped, self._swapped = self._swapped, []
        for logger, orig, repl in swapped:
            with contextlib.suppress(Exception):
                logger.removeHandler(repl)
                logger.addHandler(orig)

    def refresh(self) -> None:
        """Redraw now (the refresh thread does it when ``auto_refresh``)."""
        if self.live is not None:
            with contextlib.suppress(Exception):
                self.live.refresh()

    # reporter interface

    def update(self, status: dict) -> None:
        with contextlib.suppress(Exception):
            if isinstance(status, dict):
                self.last = status
            if self.live is None:
                self._start()
            elif not self.auto_refresh:
                self.refresh()

    def round_done(self, status: dict) -> None:
        with contextlib.suppress(Exception):
            if isinstance(status, dict):
                self.last = status
            if self.live is None:
                self._start()
            self.console.print(Text(round_line(self.last), style="dim"), soft_wrap=True, highlight=False)

    def finish(self, summary: dict) -> None:
        if self.finished:
            return
        self.finished = True
        with contextlib.suppress(Exception):
            self._stop()
            self.console.print(
                summary_paragraph(summary if isinstance(summary, Mapping) else {}, self.last),
                highlight=False,
                markup=False,
            )

    def close(self) -> None:
        self.closed = True
        self._stop()

    # the line

    def render_line(self, now: float | None = None, width: int | None = None) -> Text:
        """The live line; on a narrow terminal the least useful pieces go first (elapsed, wait, speed...)."""
        s = self.last
        head = Text()
        head.append_text(self.spinner.render(now if now is not None else time.monotonic()))  # type: ignore[arg-type]
        head.append(" ")
        phase = s.get("phase")
        head.append(str(phase) if phase else "starting", style="bold cyan")
        pieces: list[tuple[int, Text]] = []  # (priority: lower is kept longer, text), in display order

        def add(priority: int, text: str, style: str = "") -> None:
            pieces.append((priority, Text(text, style=style)))

        rt = _round_text(s)
        if rt:
            add(0, rt)
        step = _int(s.get("step"))
        if step is not None:
            add(3, f"step {step:,}")
        if _num(s.get("loss")) is not None or _num(s.get("val_loss")) is not None:
            loss = f"loss {fmt_loss(s.get('loss'))}"
            if _num(s.get("val_loss")) is not None:
                loss += f" val {fmt_loss(s.get('val_loss'))}"
            add(1, loss)
        tps = _num(s.get("tokens_per_s"))
        if tps is not None:
            add(4, f"{tps:,.0f} tok/s")
        answered, partners, members = _int(s.get("answered")), _int(s.get("partners")), _int(s.get("members"))
        if answered is not None or partners is not None:
            p = f"partners {'?' if answered is None else answered}/{'?' if partners is None else partners}"
            add(3, p + (f" of {members}" if members is not None else ""))
        elif members is not None:
            add(3, f"swarm {members}")
        if _num(s.get("bytes_sent")) is not None or _num(s.get("bytes_received")) is not None:
            add(5, f"sent {fmt_bytes(s.get('bytes_sent'))} recv {fmt_bytes(s.get('bytes_received'))}")
        t, others = _pick_transfer(s.get("transfers"))
        if t is not None:
            add(2, transfer_text(t, others, compact=True), "green")
        if _num(s.get("wait_s")) is not None:
            add(6, f"waited {fmt_duration(s.get('wait_s'))}")
        faults, banned = _count(s.get("faults")), _count(s.get("banned"))
        if faults:
            add(2, _plural(faults, "fault"), "yellow")
        if banned:
            add(2, f"{banned} banned", "red")
        wall = _num(s.get("wall_s"))
        add(7, fmt_duration(wall if wall is not None else time.monotonic() - self.t0), "dim")
        if width is not None:  # most useful first, each where it still fits; the round always (rich crops)
            budget, keep = width - head.cell_len, set()
            for i in sorted(range(len(pieces)), key=lambda i: pieces[i][0]):
                cost = len(self.SEP) + pieces[i][1].cell_len
                if cost <= budget or pieces[i][0] == 0:
                    keep.add(i)
                    budget -= cost
            pieces = [p for i, p in enumerate(pieces) if i in keep]
        out = head
        for _, text in pieces:
            out.append(self.SEP, style="dim")
            out.append_text(text)
        return out

"""What ``locomm-peer join`` shows its user: a live status line, one line per round, a summary at exit.

The node calls a reporter (``NodeOptions.reporter``) with plain dicts:

* ``update(status)`` about twice a second, from the node's asyncio loop thread: it only stores the
  dict (the live line is drawn by rich's refresh thread), so it is cheap and never blocks;
* ``round_done(status)`` after each round;
* ``finish(summary)`` once at exit;
* ``close()`` always, at the very end (also after errors): it restores the terminal.

Every key of every dict may be missing, None or NaN; no method raises.

``make_reporter`` picks one of three: nothing (``-q``), a rich live line on a terminal, or one plain
line per round for logs and containers (stderr not a TTY). The JSON-lines event log is not touched here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterable, Mapping
from typing import IO, Any, Protocol

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

__all__ = [
    "JoinReporter",
    "LiveReporter",
    "NullReporter",
    "PlainReporter",
    "fmt_bytes",
    "fmt_duration",
    "fmt_eta",
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


# -- formatting -----------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """``x`` as a finite float, or None (missing, None, NaN, inf, not a number, bool)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _int(x: Any) -> int | None:
    v = _num(x)
    return int(v) if v is not None else None


def _count(x: Any) -> int | None:
    """A count given as a number or as a collection (e.g. a list of banned peers)."""
    if isinstance(x, (list, tuple, set, frozenset, dict)):
        return len(x)
    return _int(x)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def fmt_bytes(n: Any) -> str:
    """Decimal units, three significant figures at most: ``512 B``, ``12.3 MB``, ``240 MB``, ``1.5 GB``."""
    v = _num(n)
    if v is None:
        return "?"
    sign, v = ("-", -v) if v < 0 else ("", v)
    if v < 1000:
        return f"{sign}{v:.0f} B"
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        v /= 1000
        if v < 999.5 or unit == "PB":
            return f"{sign}{v:.1f} {unit}" if v < 99.95 else f"{sign}{v:.0f} {unit}"
    raise AssertionError("unreachable")


def fmt_rate(bps: Any) -> str:
    return f"{fmt_bytes(bps)}/s"


def fmt_duration(s: Any) -> str:
    """``0.4 s``, ``42 s``, ``3m05s``, ``2h07m``, ``3d04h``; ``?`` when unknown."""
    v = _num(s)
    if v is None or v < 0:
        return "?"
    if v < 9.95:
        return f"{v:.1f} s"
    if v < 59.5:
        return f"{v:.0f} s"
    t = round(v)
    if t < 3600:
        return f"{t // 60}m{t % 60:02d}s"
    t = round(v / 60)
    if t < 24 * 60:
        return f"{t // 60}h{t % 60:02d}m"
    t = round(v / 3600)
    return f"{t // 24}d{t % 24:02d}h"


def fmt_eta(s: Any) -> str:
    """Whole seconds (an estimate): ``3 s``, ``1m05s``; ``?`` when unknown."""
    v = _num(s)
    if v is None or v < 0:
        return "?"
    return fmt_duration(max(1.0, float(math.ceil(v))) if v < 60 else v).replace(".0 s", " s")


def fmt_loss(x: Any) -> str:
    v = _num(x)
    return "?" if v is None else f"{v:.3f}"


def _short(peer: Any, n: int = 8) -> str:
    s = str(peer) if peer is not None else "?"
    return s if len(s) <= n + 1 else s[-n:]


def _round_text(status: Mapping[str, Any]) -> str | None:
    r, end = _int(status.get("round")), _int(status.get("end_round"))
    if r is None:
        return None
    return f"round {r:,}/{end:,}" if end is not None else f"round {r:,}"


def round_line(status: Mapping[str, Any]) -> str:
    """One plain line: ``round 3/10 step 150 loss 2.341 1,234 tok/s partners 1/1 sent 12.3 MB ...``.
    A field the status lacks is left out."""
    parts = [_round_text(status) or "round ?"]
    step = _int(status.get("step"))
    if step is not None:
        parts.append(f"step {step:,}")
    if _num(status.get("loss")) is not None:
        parts.append(f"loss {fmt_loss(status.get('loss'))}")
    if _num(status.get("val_loss")) is not None:
        parts.append(f"val {fmt_loss(status.get('val_loss'))}")
    tps = _num(status.get("tokens_per_s"))
    if tps is not None:
        parts.append(f"{tps:,.0f} tok/s")
    answered, partners = _int(status.get("answered")), _int(status.get("partners"))
    if answered is not None or partners is not None:
        parts.append(f"partners {'?' if answered is None else answered}/{'?' if partners is None else partners}")
    members = _int(status.get("members"))
    if members is not None:
        parts.append(f"swarm {members}")
    if _num(status.get("bytes_sent")) is not None:
        parts.append(f"sent {fmt_bytes(status.get('bytes_sent'))}")
    if _num(status.get("bytes_received")) is not None:
        parts.append(f"recv {fmt_bytes(status.get('bytes_received'))}")
    if _num(status.get("wait_s")) is not None:
        parts.append(f"wait {fmt_duration(status.get('wait_s'))}")
    faults, banned = _count(status.get("faults")), _count(status.get("banned"))
    if faults:
        parts.append(f"faults {faults}")
    if banned:
        parts.append(f"banned {banned}")
    if _num(status.get("wall_s")) is not None:
        parts.append(f"elapsed {fmt_duration(status.get('wall_s'))}")
    return " ".join(parts)


def _pick_transfer(transfers: Any) -> tuple[Mapping[str, Any] | None, int]:
    """The transfer to show (the largest one still in progress, else the largest) and how many others run."""
    if not isinstance(transfers, (list, tuple)):
        return None, 0
    ts = [t for t in transfers if isinstance(t, Mapping)]
    if not ts:
        return None, 0

    def size(t: Mapping[str, Any]) -> float:
        return _num(t.get("total")) or _num(t.get("done")) or 0.0

    def running(t: Mapping[str, Any]) -> bool:
        done, total = _num(t.get("done")), _num(t.get("total"))
        return total is None or done is None or done < total

    live = [t for t in ts if running(t)] or ts
    return max(live, key=size), len(live) - 1


def _sizes(done: float | None, total: float) -> str:
    """``4.1/10.2 MB`` (one unit when both share it), else ``512 kB/10.2 MB``."""
    d, t = fmt_bytes(done), fmt_bytes(total)
    if d.split(" ")[-1] == t.split(" ")[-1] and " " in d:
        return f"{d.split(' ')[0]}/{t}"
    return f"{d}/{t}"


def transfer_text(t: Mapping[str, Any], others: int = 0, *, compact: bool = False) -> str:
    """``recv from AbCdEf12 4.1/10.2 MB 40% at 2.3 MB/s, ETA 3 s`` (``send to`` for an upload); compact, for
    the live line: ``↓ 4.1/10.2 MB 40% 2.3 MB/s ETA 3 s`` (``↑`` for an upload)."""
    recv = t.get("direction") == "recv"
    where = ("↓" if recv else "↑") if compact else f"{'recv from' if recv else 'send to'} {_short(t.get('peer'))}"
    done, total = _num(t.get("done")), _num(t.get("total"))
    if total:
        size = _sizes(done, total)
        if done is not None:
            size += f" {min(100.0, max(0.0, 100 * done / total)):.0f}%"
    else:
        size = fmt_bytes(done)
    out = f"{where} {size}"
    if _num(t.get("rate_bps")) is not None:
        out += f" {fmt_rate(t.get('rate_bps'))}" if compact else f" at {fmt_rate(t.get('rate_bps'))}"
    out += f" ETA {fmt_eta(t.get('eta_s'))}" if compact else f", ETA {fmt_eta(t.get('eta_s'))}"
    if others > 0:
        out += f" +{others}" if compact else f" (+{others} more)"
    return out


def summary_paragraph(summary: Mapping[str, Any], last: Mapping[str, Any] | None = None) -> str:
    """The paragraph printed at exit. ``last`` (the latest status) fills in what the summary lacks."""
    last = last or {}

    def get(key: str, *fallbacks: str) -> Any:
        for k in (key, *fallbacks):
            if summary.get(k) is not None:
                return summary[k]
        for k in (key, *fallbacks):
            if last.get(k) is not None:
                return last[k]
        return None

    rounds = _int(summary.get("rounds_completed"))
    if rounds is None:
        rounds = _int(last.get("round"))
    steps = _int(get("steps", "step"))
    members = _int(get("members", "peers"))
    head = f"trained {_plural(rounds, 'round')}" if rounds is not None else "finished"
    if steps is not None:
        head += f" ({_plural(steps, 'step')})"
    if members is not None:
        head += f" with {_plural(members, 'peer')}"
    if summary.get("interrupted"):
        head = f"interrupted; {head}"
    peer = summary.get("peer") or last.get("peer")
    head = f"Peer {_short(peer)} {head}" if peer else head[0].upper() + head[1:]
    parts = [head]

    initial, final = _num(summary.get("initial_loss")), _num(summary.get("final_loss"))
    if final is None:
        final = _num(last.get("val_loss"))
    if initial is not None and final is not None:
        parts.append(f"validation loss {initial:.3f} -> {final:.3f}")
    elif final is not None or initial is not None:
        parts.append(f"validation loss {fmt_loss(final if final is not None else initial)}")

    sent, recv = get("bytes_sent"), get("bytes_received")
    if _num(sent) is not None or _num(recv) is not None:
        parts.append(f"sent {fmt_bytes(sent)}, received {fmt_bytes(recv)}")

    ok, failed = _int(summary.get("exchanges_ok")), _int(summary.get("exchanges_failed"))
    if ok is not None or failed is not None:
        parts.append(f"{_plural(ok or 0, 'exchange')} ok, {failed or 0:,} failed")

    wait, wall = _num(get("wait_s")), _num(get("wall_s"))
    if wait is not None:
        text = f"compute waited {fmt_duration(wait)} on the network"
        if wall:
            pct = 100 * wait / wall
            text += f" ({pct:.1f}% of {fmt_duration(wall)})" if pct < 9.95 else f" ({pct:.0f}% of {fmt_duration(wall)})"
        parts.append(text)

    faults = _count(get("faults"))
    banned_peers = summary.get("banned_peers")
    banned = _count(summary.get("banned"))
    if banned is None:
        banned = _count(banned_peers)
    if banned is None:
        banned = _count(last.get("banned"))
    if faults is not None or banned is not None:
        text = f"{_plural(faults or 0, 'fault')}, {_plural(banned or 0, 'peer')} banned"
        if isinstance(banned_peers, (list, tuple, set, frozenset)) and banned_peers:
            names = sorted(_short(p) for p in banned_peers)
            text += f" ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
        parts.append(text)
    return "; ".join(parts) + "."


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

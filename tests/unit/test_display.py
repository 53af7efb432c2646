"""What ``join`` shows: plain per-round lines, the summary, quiet, the live line (no network, no torch)."""

from __future__ import annotations

import io
import logging
import re

import pytest
from rich.console import Console

from locomm.cli.display import (
    LiveReporter,
    NullReporter,
    PlainReporter,
    fmt_bytes,
    fmt_duration,
    fmt_eta,
    make_reporter,
    round_line,
    summary_paragraph,
    transfer_text,
)

NAN = float("nan")
STATUS = {
    "peer": "9xQeWvG8",
    "round": 3,
    "end_round": 10,
    "step": 150,
    "loss": 2.3412,
    "val_loss": None,
    "tokens_per_s": 1234.4,
    "members": 3,
    "partners": 1,
    "answered": 1,
    "bytes_sent": 12_300_000,
    "bytes_received": 12_100_000,
    "wait_s": 0.42,
    "wall_s": 83.0,
    "phase": "exchanging",
    "faults": 0,
    "banned": 0,
    "transfers": [
        {"peer": "SmallOne", "direction": "send", "done": 10, "total": 1000, "rate_bps": 5.0, "eta_s": 200.0},
        {
            "peer": "AbCdEf12",
            "direction": "recv",
            "done": 4_100_000,
            "total": 10_200_000,
            "rate_bps": 2_300_000.0,
            "eta_s": 2.7,
        },
    ],
}
SUMMARY = {
    "peer": "12D3KooWLongPeerId9xQeWvG8",
    "rounds_completed": 10,
    "initial_loss": 5.3612,
    "final_loss": 2.2401,
    "bytes_sent": 240_000_000,
    "bytes_received": 238_000_000,
    "exchanges_ok": 20,
    "exchanges_failed": 0,
    "wait_s": 3.1,
    "faults": 0,
    "banned": 0,
    "banned_peers": [],
    "interrupted": False,
}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def term_console(width: int = 200) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=width, color_system="standard", legacy_windows=False), buf


def test_units() -> None:
    assert [fmt_bytes(x) for x in (0, 999, 1500, 12_345_678, 240e6, 1.5e9)] == [
        "0 B",
        "999 B",
        "1.5 kB",
        "12.3 MB",
        "240 MB",
        "1.5 GB",
    ]
    assert [fmt_duration(x) for x in (0.42, 42, 185, 7620, 90000)] == ["0.4 s", "42 s", "3m05s", "2h07m", "1d01h"]
    assert fmt_eta(2.2) == "3 s" and fmt_eta(0.01) == "1 s" and fmt_eta(65) == "1m05s"
    for bad in (None, NAN, float("inf"), "x", True):
        assert fmt_bytes(bad) == "?" and fmt_duration(bad) == "?" and fmt_eta(bad) == "?"


def test_plain_one_line_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # as in some CI logs: still no terminal
    out = io.StringIO()
    rep = make_reporter(quiet=False, stream=out)  # a StringIO is no terminal: plain lines
    assert isinstance(rep, PlainReporter)
    for _ in range(5):
        rep.update(STATUS)
    assert out.getvalue() == ""  # updates draw nothing without a terminal
    rep.round_done(STATUS)
    rep.round_done({**STATUS, "round": 4, "step": 200})
    lines = out.getvalue().splitlines()
    assert lines == [
        "round 3/10 step 150 loss 2.341 1,234 tok/s partners 1/1 swarm 3 sent 12.3 MB recv 12.1 MB wait 0.4 s "
        "elapsed 1m23s",
        "round 4/10 step 200 loss 2.341 1,234 tok/s partners 1/1 swarm 3 sent 12.3 MB recv 12.1 MB wait 0.4 s "
        "elapsed 1m23s",
    ]
    assert "\x1b" not in out.getvalue()
    rep.finish(SUMMARY)
    rep.finish(SUMMARY)  # once only
    rep.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[2].startswith("Peer 9xQeWvG8 trained 10 rounds (200 steps) with 3 peers;")


def test_summary_paragraph_numbers() -> None:
    text = summary_paragraph(SUMMARY, {"step": 500, "members": 2, "wall_s": 150.0})
    assert text == (
        "Peer 9xQeWvG8 trained 10 rounds (500 steps) with 2 peers; validation loss 5.361 -> 2.240; "
        "sent 240 MB, received 238 MB; 20 exchanges ok, 0 failed; compute waited 3.1 s on the network "
        "(2.1% of 2m30s); 0 faults, 0 peers banned."
    )
    bad = summary_paragraph(
        {
            "interrupted": True,
            "rounds_completed": 1,
            "faults": 4,
            "banned": 2,
            "banned_peers": ["12D3KooWaaaaaaaaaa", "12D3KooWbbbbbbbbbb"],
        }
    )
    assert bad == "Interrupted; trained 1 round; 4 faults, 2 peers banned (aaaaaaaa, bbbbbbbb)."


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"round": None, "loss": NAN, "tokens_per_s": float("inf"), "bytes_sent": None, "transfers": None},
        {"round": "3", "step": "x", "partners": NAN, "transfers": [None, 5, {"direction": "recv"}]},
        {"transfers": [{"peer": None, "done": None, "total": 0, "rate_bps": NAN, "eta_s": None}], "banned": ["a", "b"]},
    ],
)
def test_missing_none_nan_never_raise(status: dict) -> None:
    assert round_line(status).startswith("round ?")
    assert summary_paragraph(status, status).endswith(".")
    summary_paragraph({k: NAN for k in SUMMARY})
    summary_paragraph({k: None for k in SUMMARY})
    console, buf = term_console()
    for rep in (PlainReporter(io.StringIO()), LiveReporter(console, auto_refresh=False), NullReporter()):
        rep.update(status)
        rep.update(None)  # type: ignore[arg-type]
        rep.round_done(status)
        rep.finish(status)
        rep.finish(None)  # type: ignore[arg-type]
        rep.close()
        rep.close()
    assert "unavailable" not in buf.getvalue() and "Traceback" not in buf.getvalue()


def test_quiet_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    rep = make_reporter(quiet=True, stream=out)
    assert isinstance(rep, NullReporter)
    rep.update(STATUS)
    rep.round_done(STATUS)
    rep.finish(SUMMARY)
    rep.close()
    assert out.getvalue() == ""
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_transfer_choice_and_text() -> None:
    assert transfer_text(STATUS["transfers"][1]) == "recv from AbCdEf12 4.1/10.2 MB 40% at 2.3 MB/s, ETA 3 s"
    assert transfer_text(STATUS["transfers"][0], compact=True) == "↑ 10 B/1.0 kB 1% 5 B/s ETA 3m20s"


def test_live_line_in_a_terminal() -> None:
    console, buf = term_console()
    rep = make_reporter(quiet=False, console=console)
    assert isinstance(rep, LiveReporter)
    rep.auto_refresh = False  # draw on each update, not from rich's thread: deterministic
    rep.update(STATUS)
    rep.update(STATUS)
    shown = ANSI.sub("", buf.getvalue())
    assert "exchanging" in shown and "round 3/10 · step 150" in shown and "loss 2.341" in shown
    assert "1,234 tok/s" in shown and "partners 1/1 of 3" in shown and "sent 12.3 MB recv 12.1 MB" in shown
    # the largest transfer in progress, with its rate and ETA, and how many more run
    assert "↓ 4.1/10.2 MB 40% 2.3 MB/s ETA 3 s +1" in shown and "waited 0.4 s" in shown
    assert "\x1b[?25l" in buf.getvalue()  # the cursor is hidden while live
    rep.round_done({**STATUS, "transfers": []})
    rep.finish(SUMMARY)
    tail = buf.getvalue()
    assert tail.endswith("\n") and "\x1b[?25h" in tail  # the cursor is back
    assert "round 3/10 step 150 loss 2.341" in ANSI.sub("", tail)
    assert "Peer 9xQeWvG8 trained 10 rounds" in ANSI.sub("", tail).replace("\n", " ")
    assert rep.live is None
    rep.close()


def test_live_line_fits_narrow_terminals() -> None:
    for width in (40, 60, 80, 120):
        rep = LiveReporter(term_console(width)[0], auto_refresh=False)
        rep.last = STATUS
        line = rep.render_line(0.0, width)
        assert line.cell_len <= width and "round 3/10" in line.plain
        assert ("↓ 4.1/10.2 MB" in line.plain) == (width >= 80)  # the transfer before speed and traffic


def test_live_routes_logs_above_the_line() -> None:
    console, buf = term_console()
    logger = logging.getLogger("locomm.test_display")
    handler = logging.StreamHandler(console.file)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        rep = LiveReporter(console, auto_refresh=False, loggers=("locomm.test_display",))
        rep.update(STATUS)
        assert handler not in logger.handlers  # swapped for one printing through the console
        logger.info("peer up; others join with --initial-peers /ip4/127.0.0.1/tcp/1")
        rep.close()
        assert logger.handlers == [handler]  # restored
        shown = ANSI.sub("", buf.getvalue())
        assert "INFO locomm.test_display: peer up; others join" in shown
    finally:
        logger.handlers[:] = []
        logger.propagate = True


def test_close_without_finish_restores_terminal() -> None:
    console, buf = term_console()
    rep = LiveReporter(console, auto_refresh=True, refresh_per_second=20)
    rep.update(STATUS)
    assert rep.live is not None and rep.live.is_started
    rep.close()
    assert rep.live is None and "\x1b[?25h" in buf.getvalue()
    rep.update(STATUS)  # after close: nothing restarts
    assert rep.live is None

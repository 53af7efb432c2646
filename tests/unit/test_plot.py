"""`locomm-peer plot` and the swarm's figure: the points drawn are the points measured, and no more.

The logs are written here in the event logger's format (one JSON object per line, as
``locomm.peer.metrics.EventLog`` writes them, NaN included), so the reader is tested on the file format it
reads in a real swarm.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from locomm.cli.plot import _broken, draw, from_events, plot, read_logs, write_figure
from locomm.cli.swarm_view import peer_rows, write_swarm_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, events: list[dict[str, Any]], extra: list[str] = ()) -> Path:
    lines = [json.dumps({"time": 1.0 + i, **e}) for i, e in enumerate(events)]  # NaN as NaN, as EventLog does
    path.write_text("\n".join([*lines, *extra]) + "\n", encoding="utf-8")
    return path


def _dp_log(peer: int, rounds: int, eval_every: int, *, final_as_eval: bool = True) -> list[dict[str, Any]]:
    """A data-parallel peer: an eval at the start and every ``eval_every`` rounds, round events carrying
    the last evaluation forward in val_loss (a value the reader must not take for a measurement)."""
    ev: list[dict[str, Any]] = [{"event": "started", "peer": f"12D3Koo{peer}", "run": "r1", "algo": "noloco"}]
    val = 5.0 + peer
    ev.append({"event": "eval", "round": 0, "val_loss": val})
    for r in range(1, rounds + 1):
        ev.append({"event": "round", "round": r, "loss": 5.0 - 0.1 * r + peer, "val_loss": val, "bytes_sent": 10})
        if eval_every and r % eval_every == 0 and (final_as_eval or r < rounds):
            val = 5.0 - 0.1 * r + peer + 0.05
            ev.append({"event": "eval", "round": r, "val_loss": val})
    final = 5.0 - 0.1 * rounds + peer + 0.01
    if final_as_eval:
        ev.append({"event": "eval", "round": rounds, "val_loss": final})
    ev.append({"event": "finished", "rounds_completed": rounds, "initial_loss": 5.0 + peer, "final_loss": final})
    return ev


def test_reader_gives_exactly_the_measured_points(tmp_path: Path) -> None:
    _write(tmp_path / "peer0.jsonl", _dp_log(0, rounds=6, eval_every=3))
    (c,) = read_logs([tmp_path / "peer0.jsonl"]).curves
    assert c.unit == "round" and c.peer == "12D3Koo0" and c.stage is None
    assert [x for x, _ in c.train] == [1, 2, 3, 4, 5, 6]  # each round at the round it finished
    assert c.train[0][1] == 5.0 - 0.1
    # validation at the eval rounds only: 0, 3, 6 (both evals of round 6 are measurements), none invented,
    # and the finished event's final_loss is not added again beside its round's eval
    assert c.val == [(0, 5.0), (3, 5.0 - 0.3 + 0.05), (6, 5.0 - 0.6 + 0.05), (6, 5.0 - 0.6 + 0.01)]


def test_old_log_takes_the_final_loss_and_draws_no_line_across_the_run(tmp_path: Path) -> None:
    """The bug: validation at round 0 and the last round, joined by a straight line over the whole run."""
    _write(tmp_path / "peer0.jsonl", _dp_log(0, rounds=5, eval_every=0, final_as_eval=False))
    run = read_logs([tmp_path / "peer0.jsonl"])
    (c,) = run.curves
    assert c.val == [(0, 5.0), (5, 5.0 - 0.5 + 0.01)]
    fig = draw(run)
    try:
        val_line = next(ln for ln in fig.axes[0].lines if ln.get_linestyle() == "--")
        xs = list(val_line.get_xdata())
        assert xs[0] == 0 and math.isnan(xs[1]) and xs[2] == 5  # two markers, no segment between them
        assert val_line.get_marker() == "o"
    finally:
        import matplotlib.pyplot as plt  # noqa: PLC0415

        plt.close(fig)
    assert _broken([(0, 1.0), (1, 0.9), (2, 0.8)]) == ([0, 1, 2], [1.0, 0.9, 0.8])  # consecutive: one line
    assert math.isnan(_broken([(0, 1.0), (2, 0.8)])[0][1])


def test_pipeline_stage_zero_carries_the_loss(tmp_path: Path) -> None:
    s0 = [{"event": "started", "peer": "A", "stage": 0, "algo": "diloco"}]
    s0 += [{"event": "eval", "step": 0, "val_loss": 5.5}]
    s0 += [{"event": "step", "step": s, "loss": 5.5 - 0.1 * s, "lost": 0} for s in range(1, 5)]
    s0 += [{"event": "step", "step": 5, "loss": None, "lost": 2}]  # every micro-batch lost: no loss
    s0 += [{"event": "eval", "step": 5, "val_loss": 5.0}]
    s0 += [{"event": "finished", "stage": 0, "steps": 5, "final_loss": 5.0}]
    s1 = [{"event": "started", "peer": "B", "stage": 1, "algo": "diloco"}]
    s1 += [{"event": "finished", "stage": 1, "steps": 5, "final_loss": math.nan}]
    _write(tmp_path / "peer0.jsonl", s0)
    _write(tmp_path / "peer1.jsonl", s1)
    run = read_logs([tmp_path])
    a, b = run.curves
    assert (a.label, a.unit, a.stage) == ("stage 0 peer0", "step", 0)
    assert [x for x, _ in a.train] == [1, 2, 3, 4] and a.val == [(0, 5.5), (5, 5.0)]
    assert b.stage == 1 and b.train == [] and b.val == []  # NaN final loss is no measurement
    assert "pipeline, 2 stages x 1 replica" in run.title and "diloco" in run.title


def test_bad_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    bad = ['{"event": "round", "round": 3, "lo', "not json", "[1, 2]", '{"no_event": 1}', ""]
    f = _write(tmp_path / "peer0.jsonl", _dp_log(0, rounds=2, eval_every=1), extra=bad)
    run = read_logs([f])
    assert run.bad_lines == 4  # the blank line is not counted
    assert [x for x, _ in run.curves[0].train] == [1, 2]


def test_figure_is_a_png_written_atomically(tmp_path: Path) -> None:
    logs = [_dp_log(i, rounds=4, eval_every=2) for i in range(3)]
    run = from_events([(f"peer{i}", ev) for i, ev in enumerate(logs)])
    assert "noloco" in run.title and "3 peers" in run.title and "run r1" in run.title
    out = write_figure(tmp_path / "fig" / "run.png", run)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 300
    assert [p.name for p in out.parent.iterdir()] == ["run.png"]  # no temporary file left


def test_swarm_plot_reads_the_swarm_folder(tmp_path: Path) -> None:
    for i in range(2):
        _write(tmp_path / f"peer{i}.jsonl", _dp_log(i, rounds=3, eval_every=1))
    out = tmp_path / "locomm-swarm.png"
    write_swarm_plot(out, peer_rows(tmp_path, 2))
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_command(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(2):
        _write(logs / f"peer{i}.jsonl", _dp_log(i, rounds=4, eval_every=2), extra=["garbage"])
    (logs / "peer0.err").write_text("Traceback: not a log\n")
    (logs / "daemon.log").write_text("INFO a text log, passed over in a folder\n")
    runner = CliRunner()
    out = tmp_path / "fig.png"
    res = runner.invoke(plot, [str(logs), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["bad_lines"] == 2 and got["out"] == str(out)
    assert [s["label"] for s in got["series"]] == ["peer0", "peer1"]
    assert [x for x, _ in got["series"][1]["val"]] == [0, 2, 4, 4]
    assert out.read_bytes()[:8] == PNG_MAGIC

    empty = _write(tmp_path / "empty.jsonl", [], extra=["junk", "more junk"])
    res = runner.invoke(plot, [str(empty), "--out", str(tmp_path / "e.png")])
    assert res.exit_code == 2 and "error:" in res.output and "no locomm events" in res.output
    assert not (tmp_path / "e.png").exists()
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "x.log").write_text("hello\n")
    res = runner.invoke(plot, [str(text_only), "--json"])
    assert res.exit_code == 2 and "no locomm event log" in res.output
    started_only = _write(tmp_path / "s.jsonl", [{"event": "started", "peer": "A"}])
    res = runner.invoke(plot, [str(started_only), "--json"])
    assert res.exit_code == 2 and "no measured loss" in res.output
    res = runner.invoke(plot, [str(logs / "peer0.jsonl"), "--out", str(tmp_path / "f.nosuchformat")])
    assert res.exit_code == 2 and "error:" in res.output

"""`locomm-peer plot LOGS...`: each peer's training and validation loss, read back from its JSON-lines log.

One figure per run, drawn the same way for a local swarm (`locomm-peer swarm --plot`, through
:func:`locomm.cli.swarm_view.write_swarm_plot`) and for the logs of any swarm's peers (``join
--log-file``), copied to one machine. x: the outer round (a pipeline: the optimizer step); y: loss in
nats/byte, with bits/byte on the right axis; one colour per peer, training solid and thin, validation
as markers on a dashed line.

Notable:
- Only measured points are drawn. Validation comes from ``eval`` events (at the start, every
  ``--eval-every`` rounds, at the end); a ``finished`` event's ``final_loss`` is added only where no
  ``eval`` event has its round (logs written before the final evaluation was an ``eval`` event). A
  ``round`` event's ``val_loss`` is the last evaluation carried forward, not a measurement, and is not
  read. Training loss comes from ``round`` events: the mean of that round's inner-step losses, drawn at
  the round it finished.
- A line joins two points only when their rounds (steps) are consecutive; across a round that was not
  measured the markers stand alone, so no line stands for a measurement that was not made.
- A pipeline's loss is computed by its last stage and handed back to the stage-0 replica that sent the
  micro-batch, which logs it (``step`` and ``eval`` events, counted in optimizer steps): stage-0 replicas
  carry the curves; the other stages' logs hold none and appear in the JSON only.
- Reading never fails on a bad line (a line being written, a killed writer's last): it is skipped and
  counted. A file named on the command line without one locomm event is an error (exit 2); in a folder,
  such files (a text log beside the event logs) are passed over.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from locomm.config import ConfigError

LOG_SUFFIXES = (".jsonl", ".ndjson", ".log")
"""In a folder, the files read as event logs (each kept only if it holds at least one locomm event)."""

LN2 = math.log(2.0)

Point = tuple[int, float]


@dataclass
class Curve:
    """One peer's measured losses in nats/byte, as ``(x, loss)`` pairs in log order."""

    label: str
    """How the legend names the peer (``peer 0``, ``stage 0 peer0``)."""
    unit: str
    """What x counts: ``round`` (data-parallel) or ``step`` (a pipeline stage's optimizer steps)."""
    train: list[Point] = field(default_factory=list)
    """Training loss: a round's mean inner-step loss at the round it finished (a pipeline: each step's)."""
    val: list[Point] = field(default_factory=list)
    """Validation loss where it was measured."""
    peer: str = ""
    """The peer's id, from its ``started`` event ("" without one)."""
    stage: int | None = None
    """A pipeline peer's stage; None for a data-parallel peer."""
    source: str = ""
    """The log it was read from."""


@dataclass
class RunCurves:
    """What one run's logs hold: a curve per peer, the figure's title, and the lines that did not parse."""

    curves: list[Curve]
    title: str
    bad_lines: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "bad_lines": self.bad_lines, "series": [asdict(c) for c in self.curves]}

    @property
    def measured(self) -> int:
        """How many points there are to draw."""
        return sum(len(c.train) + len(c.val) for c in self.curves)


# -- reading ----------------------------------------------------------------------------------------------


def parse_log(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The locomm events of one JSON-lines file, and how many non-blank lines were not one."""
    events, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(e, dict) and isinstance(e.get("event"), str):
                events.append(e)
            else:
                bad += 1
    return events, bad


def _x(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _loss(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _point(e: dict[str, Any], xkey: str, ykey: str) -> Point | None:
    x, y = _x(e.get(xkey)), _loss(e.get(ykey))
    return (x, y) if x is not None and y is not None else None


def curve_of(events: Sequence[dict[str, Any]], label: str, source: str = "") -> Curve:
    """The measured points of one peer's events (see the module's notes for which events count)."""
    started = next((e for e in events if e["event"] == "started"), {})
    stage = _x(started.get("stage"))
    piped = stage is not None or any(e["event"] == "step" for e in events)
    unit = "step" if piped else "round"
    train_event, done_key = ("step", "steps") if piped else ("round", "rounds_completed")
    c = Curve(label=label, unit=unit, peer=str(started.get("peer", "")), stage=stage, source=source)
    for e in events:
        kind = e["event"]
        if kind == train_event and (p := _point(e, unit, "loss")):
            c.train.append(p)
        elif kind == "eval" and (p := _point(e, unit, "val_loss")):
            c.val.append(p)
    for e in events:
        p = _point(e, done_key, "final_loss") if e["event"] == "finished" else None
        if p and all(x != p[0] for x, _ in c.val):  # an old log: the final evaluation was not an eval event
            c.val.append(p)
    return c


def run_title(peers: Sequence[Sequence[dict[str, Any]]], curves: Sequence[Curve]) -> str:
    """The run's algorithm (and preset, run id) from the peers' ``started`` events, and its shape."""
    started = [next((e for e in ev if e["event"] == "started"), {}) for ev in peers]
    parts = []
    for key in ("algo", "preset"):
        vals = sorted({str(s[key]) for s in started if s.get(key) not in (None, "")})
        if vals:
            parts.append("/".join(vals))
    stages = sorted({c.stage for c in curves if c.stage is not None})
    if stages:
        per = sum(c.stage == stages[0] for c in curves)
        parts.append(f"pipeline, {len(stages)} stages x {per} replica{'s' * (per != 1)}")
    else:
        parts.append(f"{len(curves)} peer{'s' if len(curves) != 1 else ''}")
    runs = sorted({str(s["run"]) for s in started if s.get("run")})
    if len(runs) == 1:
        parts.append(f"run {runs[0]}")
    return "locomm: " + ", ".join(parts)


def from_events(named: Sequence[tuple[str, Sequence[dict[str, Any]]]], bad_lines: int = 0) -> RunCurves:
    """One run's curves from ``(label, events)`` per peer (what `locomm-peer swarm` holds in memory)."""
    curves = []
    for label, ev in named:
        c = curve_of(ev, label)
        if c.stage is not None:
            c.label = f"stage {c.stage} {label}"
        curves.append(c)
    return RunCurves(curves, run_title([ev for _, ev in named], curves), bad_lines)


def _natural(p: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def read_logs(paths: Sequence[Path]) -> RunCurves:
    """The curves of the peers whose logs are ``paths`` (files, or folders searched for ``*.jsonl`` and
    ``*.log`` files holding locomm events). ConfigError for a named file with no event, a folder with no
    event log, or a path that is neither."""
    logs: list[tuple[Path, list[dict[str, Any]]]] = []
    bad = 0
    for path in paths:
        path = Path(path)
        if path.is_dir():
            found = 0
            for f in sorted((f for f in path.rglob("*") if f.suffix in LOG_SUFFIXES and f.is_file()), key=_natural):
                ev, n = parse_log(f)
                if ev:
                    logs.append((f, ev))
                    bad, found = bad + n, found + 1
            if not found:
                raise ConfigError(f"{path}: no locomm event log (*{', *'.join(LOG_SUFFIXES)}) in this folder")
        elif path.is_file():
            ev, n = parse_log(path)
            if not ev:
                raise ConfigError(f"{path}: no locomm events in this file ({n} lines that are not one)")
            logs.append((path, ev))
            bad += n
        else:
            raise ConfigError(f"{path}: no such file or folder")
    stems = [f.stem for f, _ in logs]
    labels = [f.stem if stems.count(f.stem) == 1 else str(f) for f, _ in logs]
    run = from_events([(lab, ev) for lab, (_, ev) in zip(labels, logs)], bad)
    for c, (f, _) in zip(run.curves, logs):
        c.source = str(f)
    return run


# -- drawing ----------------------------------------------------------------------------------------------


def _broken(points: Sequence[Point]) -> tuple[list[float], list[float]]:
    """x and y with a NaN between two points whose x are not consecutive: matplotlib draws no line there."""
    xs: list[float] = []
    ys: list[float] = []
    for x, y in points:
        if xs and not 0 <= x - xs[-1] <= 1:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(x)
        ys.append(y)
    return xs, ys


def draw(run: RunCurves) -> Any:
    """The run's figure (a matplotlib Figure, Agg backend): one axes, a colour per peer."""
    import matplotlib  # noqa: PLC0415 - heavy; --help stays instant

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.lines import Line2D  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = [c for c in run.curves if c.train or c.val]
    cmap = matplotlib.colormaps["tab10" if len(drawn) <= 10 else "tab20"]
    peers = []
    for i, c in enumerate(drawn):
        colour = cmap(i % cmap.N)
        if c.train:
            ax.plot(*_broken(c.train), color=colour, linewidth=1.0, marker=".", markersize=2)
        if c.val:
            ax.plot(*_broken(c.val), color=colour, linewidth=1.2, linestyle="--", marker="o", markersize=4)
        peers.append(Line2D([], [], color=colour, linewidth=3, label=c.label))
    units = {c.unit for c in drawn} or {"round"}
    each = "round's inner steps" if units == {"round"} else "step's micro-batches"
    styles = [
        Line2D([], [], color="0.3", linewidth=1.0, label=f"train (mean of the {each}, at its end)"),
        Line2D([], [], color="0.3", linewidth=1.2, linestyle="--", marker="o", markersize=4, label="validation"),
    ]
    if peers:
        first = ax.legend(handles=peers, fontsize=7, loc="upper right", ncol=1 + len(peers) // 9, title="peer")
        ax.add_artist(first)
        ax.legend(handles=styles, fontsize=7, loc="upper center")
    else:
        ax.text(0.5, 0.5, "no loss measured", transform=ax.transAxes, ha="center", va="center", color="0.4")
    silent = [c for c in run.curves if c.stage is not None and not (c.train or c.val)]
    if silent:  # a pipeline's later stages: the loss is logged by stage 0
        quiet = sorted({c.stage for c in silent})
        note = f"stage{'s' * (len(quiet) > 1)} {', '.join(map(str, quiet))} log{'s' * (len(quiet) == 1)} no loss"
        note += " (stage 0 logs the loss the last stage returns)"
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=7, color="0.4")
    ax.set_xlabel("outer round" if units == {"round"} else ("optimizer step" if units == {"step"} else "round / step"))
    ax.set_ylabel("loss (nats/byte)")
    ax.secondary_yaxis("right", functions=(lambda n: n / LN2, lambda b: b * LN2)).set_ylabel("bits/byte")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.set_title(run.title, fontsize=9)
    fig.tight_layout()
    return fig


def write_figure(path: Path, run: RunCurves) -> Path:
    """Draw ``run`` to ``path`` atomically (a reader sees the old file or the new one); the format is the
    suffix's (PNG without one). ValueError for a format matplotlib does not write."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from locomm.atomic import atomic_path  # noqa: PLC0415

    path = Path(path)
    fig = draw(run)
    try:
        with atomic_path(path) as tmp:  # the temp name ends in .tmp: the format is given
            fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
    return path


# -- the command ------------------------------------------------------------------------------------------


@click.command("plot")
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The figure (PNG; the suffix picks another format). Default: locomm-plot.png, or none with --json.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the measured series as one JSON object.")
def plot(logs: tuple[Path, ...], out: Path | None, as_json: bool) -> None:
    """Train and validation loss of a run, from its peers' JSON-lines logs (files or folders)."""
    from locomm.cli.options import emit_json, fail  # noqa: PLC0415

    try:
        run = read_logs(logs)
    except (ConfigError, OSError) as e:
        fail(str(e))
    if not run.measured:
        fail(f"no measured loss in {len(run.curves)} log(s): no round, step or eval event with a finite loss")
    if run.bad_lines:
        click.echo(f"skipped {run.bad_lines} line(s) that are not locomm events", err=True)
    if out is None and not as_json:
        out = Path("locomm-plot.png")
    if out is not None:
        try:
            write_figure(out, run)
        except (ValueError, OSError) as e:
            fail(f"--out {out}: {e}")
        if not as_json:
            click.echo(f"{out}: {len(run.curves)} peers, {run.measured} points")
    if as_json:
        emit_json({**run.as_json(), "out": str(out) if out else None})

"""What a local swarm's peers report, read back from their JSON-lines logs: rows, live tables, summaries.

Pure functions of a log folder (``peer<i>.jsonl``, ``peer<i>.safetensors``), so everything here can be
tested without starting a peer; :mod:`locomm.cli.local_swarm` starts the processes and calls these.
Both modes read the same events: ``started``, ``finished``, and ``round`` (data-parallel) or ``step``
(a pipeline stage).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from locomm.cli.plot import from_events, write_figure
from locomm.config import RunSpec


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one peer's JSON-lines log; a line being written (or a killed writer's last) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(e, dict):
            out.append(e)
    return out


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in events if e["event"] == kind), None)


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next((e for e in reversed(events) if e["event"] == kind), {})


# -- rows and tables --------------------------------------------------------------------------------------


def peer_rows(folder: Path, n: int) -> list[dict[str, Any]]:
    """One row per data-parallel peer: its latest round, loss, speed and traffic."""
    rows = []
    for i in range(n):
        ev = read_events(folder / f"peer{i}.jsonl")
        last_round = _last(ev, "round")
        started = _first(ev, "started") or {}
        finished = _first(ev, "finished")
        rows.append(
            {
                "peer": i,
                "id": started.get("peer", "")[-8:],
                "round": last_round.get("round", 0),
                "loss": last_round.get("loss"),
                "val_loss": last_round.get("val_loss"),
                "tokens_per_s": last_round.get("tokens_per_s"),
                "bytes_sent": last_round.get("bytes_sent", 0),
                "answered": last_round.get("answered"),
                "state": "done" if finished else ("training" if started else "starting"),
                "events": ev,
            }
        )
    return rows


def stage_rows(folder: Path, n: int, replicas: int) -> list[dict[str, Any]]:
    """One row per pipeline peer: its stage, step, loss, lost and re-routed micro-batches."""
    rows = []
    for i in range(n):
        ev = read_events(folder / f"peer{i}.jsonl")
        started = _first(ev, "started") or {}
        finished = _first(ev, "finished")
        last = _last(ev, "step")
        rows.append(
            {
                "peer": i,
                "stage": started.get("stage", i // replicas),
                "id": started.get("peer", "")[-8:],
                "state": "done" if finished else ("serving" if started else "starting"),
                "step": (finished or last).get("step", 0),
                "loss": last.get("loss"),
                "lost": (finished or last).get("microbatches_lost", last.get("lost", 0)),
                "rerouted": (finished or last).get("microbatches_rerouted", last.get("rerouted", 0)),
                "finished": finished,
                "events": ev,
            }
        )
    return rows


def peer_table(rows: list[dict[str, Any]], rounds: int) -> Table:
    t = Table(title=f"locomm swarm: {len(rows)} peers, {rounds} rounds")
    for col in ("peer", "id", "state", "round", "loss", "val", "tok/s", "MB sent", "got"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["peer"]),
            r["id"],
            r["state"],
            f"{r['round']}/{rounds}",
            _f(r["loss"]),
            _f(r["val_loss"]),
            _f(r["tokens_per_s"], "{:,.0f}"),
            f"{r['bytes_sent'] / 1e6:.1f}",
            str(r["answered"] or "-"),
        )
    return t


def stage_table(rows: list[dict[str, Any]], stages: int, steps: int) -> Table:
    t = Table(title=f"locomm pipeline: {stages} stages, {len(rows) // max(1, stages)} replicas each, {steps} steps")
    for col in ("stage", "peer", "id", "state", "step", "loss", "lost", "re-routed"):
        t.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["stage"], r["peer"])):
        t.add_row(
            str(r["stage"]),
            str(r["peer"]),
            r["id"],
            r["state"],
            f"{r['step']}/{steps}",
            _f(r["loss"]),
            str(r["lost"]),
            str(r["rerouted"]),
        )
    return t


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


class _NoLive:
    """Stands in for rich's Live when the launcher is quiet."""

    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, *_: Any) -> None:
        return None


def live_table(first: Table, console: Console, quiet: bool) -> Live | _NoLive:
    """The live table on ``console`` (redrawn twice a second), or nothing when ``quiet``."""
    return _NoLive() if quiet else Live(first, console=console, refresh_per_second=2, transient=False)


# -- summaries --------------------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _wall(events: list[dict[str, Any]]) -> float:
    rounds = [e for e in events if e["event"] == "round"]
    return rounds[-1]["wall_s"] if rounds else 0.0


def max_weight_distance(files: list[Path]) -> float:
    """The largest L2 distance between any two peers' final weights (NaN with fewer than two)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    flats = []
    for f in files:
        if f.exists():
            w = load_file(str(f))
            flats.append(torch.cat([w[k].flatten() for k in sorted(w)]))
    return max((float((a - b).norm()) for i, a in enumerate(flats) for b in flats[i + 1 :]), default=float("nan"))


def swarm_summary(folder: Path, rows: list[dict[str, Any]], *, peers: int, rounds: int) -> dict[str, Any]:
    """What the data-parallel peers report: losses, traffic, weight agreement, time waiting on the network."""
    finals = [_first(r["events"], "finished") for r in rows]
    done = [f for f in finals if f]
    return {
        "peers": peers,
        "rounds": rounds,
        "rounds_completed": min((f["rounds_completed"] for f in done), default=0)
        if len(done) == peers
        else min((r["round"] for r in rows), default=0),
        "initial_loss": _mean([f["initial_loss"] for f in done]),
        "final_loss": _mean([f["final_loss"] for f in done]),
        "bytes_sent": sum(f["bytes_sent"] for f in done),
        "max_weight_distance": max_weight_distance([folder / f"peer{i}.safetensors" for i in range(peers)]),
        "wait_fraction": _mean([f["wait_s"] / max(1e-9, _wall(r["events"])) for f, r in zip(finals, rows) if f]),
        "first_heartbeat_s": max((f["first_heartbeat_s"] for f in done), default=None),
    }


def timeline_stats(finals: list[dict[str, Any]], stages: int) -> dict[str, Any]:
    """Bubble fraction and per-stage overlap share from the peers' compute timestamps (one machine's clock)."""
    from locomm.sim.pipeline import overlap_by_stage  # noqa: PLC0415

    drivers = [f for f in finals if f["stage"] == 0 and f["compute_intervals"]]
    if not drivers:
        return {}
    t0 = min(iv[0] for f in drivers for iv in f["compute_intervals"])
    t1 = max(iv[1] for f in drivers for iv in f["compute_intervals"])
    span = max(1e-9, t1 - t0)
    busy = 0.0
    intervals = []
    for f in finals:
        for a, b, _kind in f["compute_intervals"]:
            a, b = max(a, t0), min(b, t1)
            if b > a:
                busy += b - a
                intervals.append((a, b, f["stage"]))
    return {
        "bubble_fraction": 1.0 - busy / (len(finals) * span),
        "train_span_s": span,
        "stage_overlap_share": {str(s): v for s, v in overlap_by_stage(intervals, stages).items()},
    }


def pipeline_summary(rows: list[dict[str, Any]], spec: RunSpec, *, stages: int, replicas: int) -> dict[str, Any]:
    """What the stage peers report: losses (stage 0, through the whole pipeline), lost and re-routed
    micro-batches, bytes per token per boundary, replica syncs, the bubble; a late joiner's own figures
    when ``rows`` has more than ``stages * replicas`` peers (its row is the last)."""
    n = stages * replicas
    finals = [r["finished"] for r in rows if r["finished"]]
    drivers = [f for f in finals if f["stage"] == 0]
    wire = sum(f["bytes_fwd"] + f["bytes_tokens"] + f["bytes_bwd"] for f in finals)
    crossed = sum(f["tokens_forwarded"] for f in finals)
    stats = timeline_stats(finals, stages)
    trained = sum(f["steps"] for f in drivers) * spec.data.batch_size * spec.data.seq_len
    joiner = rows[-1] if len(rows) > n else None
    return {
        "stages": stages,
        "replicas": replicas,
        "peers": len(rows),
        "initial_loss": _mean([f["initial_loss"] for f in drivers]),
        "final_loss": _mean([f["final_loss"] for f in drivers]),
        "steps": min((f["steps"] for f in drivers), default=0),
        "microbatches_lost": sum(f["microbatches_lost"] for f in drivers),
        "microbatches_rerouted": sum(f["microbatches_rerouted"] for f in finals),
        "bytes_per_token_per_boundary": wire / crossed if crossed else float("nan"),
        "stage_of_peer": [r["stage"] for r in rows],
        "joiner_stage": (_first(joiner["events"], "started") or {}).get("stage") if joiner else None,
        "joiner_synced": _first(joiner["events"], "synced") is not None if joiner else None,
        "joiner_microbatches": (joiner["finished"] or {}).get("microbatches") if joiner else None,
        "faults": sum(f["faults"] for f in finals),
        "replica_syncs": {
            str(st): {k: sum(f.get(f"exchanges_{k}", 0) for f in finals if f["stage"] == st) for k in ("ok", "failed")}
            for st in range(stages)
        },
        "joiner_syncs": (
            {k: (joiner["finished"] or {}).get(f"exchanges_{k}") for k in ("ok", "failed")} if joiner else None
        ),
        "tokens_trained": trained,
        "tokens_per_s": trained / stats["train_span_s"] if stats.get("train_span_s") else None,
        **stats,
    }


def write_swarm_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """The run's figure from the rows of :func:`peer_rows` or :func:`stage_rows`, written atomically: the
    figure of `locomm-peer plot` (:mod:`locomm.cli.plot`), each peer labelled by its index."""
    try:
        import matplotlib  # noqa: F401, PLC0415 - a dependency, but the swarm's results matter more
    except ImportError:
        return
    write_figure(path, from_events([(f"peer{r['peer']}", r["events"]) for r in rows]))

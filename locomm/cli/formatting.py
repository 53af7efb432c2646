"""The words and numbers of what ``join`` shows: sizes, durations, the per-round line, a transfer, the summary.

Pure functions of plain dicts (the node's status and summary), used by the reporters of
:mod:`locomm.cli.display`. Every key may be missing, None or NaN: a field that is not there is left out
(or shown as ``?``), and nothing here raises on odd input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "fmt_bytes",
    "fmt_duration",
    "fmt_eta",
    "fmt_loss",
    "fmt_rate",
    "round_line",
    "summary_paragraph",
    "transfer_text",
]


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

"""The process table, read from /proc (Linux), for the tests and benchmarks that check what a peer leaves running.

One reader for every rig that asks "which processes did this start, and are they gone": the lifetime tests,
the swarm tests' Ctrl-C checks, chaos's orphan scan. No psutil (the project does not depend on it). Off
Linux every table is empty; callers that need it skip first (``available()``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Proc", "alive", "available", "cmdline", "descendants", "stat", "table"]

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    """One line of /proc/<pid>/stat, the fields the rigs use."""

    pid: int
    ppid: int
    pgid: int
    state: str
    """R, S, D, ... ; Z a zombie nobody has reaped yet, X dead."""
    comm: str
    """The executable's name, cut to 15 characters by the kernel ("p2pd", "python3")."""

    @property
    def live(self) -> bool:
        return self.state not in ("Z", "X")


def available() -> bool:
    return (PROC / "self" / "stat").exists()


def _parse(pid: int, text: str) -> Proc:
    head, tail = text.rsplit(")", 1)  # comm may hold spaces and parentheses: split at the last one
    fields = tail.split()
    return Proc(pid=pid, ppid=int(fields[1]), pgid=int(fields[2]), state=fields[0], comm=head.split("(", 1)[1])


def stat(pid: int) -> Proc | None:
    """``pid``'s entry, or None when there is no such process."""
    try:
        return _parse(pid, (PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def table(*, zombies: bool = False) -> dict[int, Proc]:
    """Every process, by pid; zombies only when asked (a zombie has exited, only its parent has not reaped it)."""
    out = {}
    if not available():
        return out
    for d in os.listdir(PROC):
        if d.isdigit() and (p := stat(int(d))) is not None and (zombies or p.live):
            out[p.pid] = p
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has)."""
    p = stat(pid)
    return p is not None and p.live


def cmdline(pid: int) -> str:
    """``pid``'s arguments, each followed by a space ("" when it is gone or is a kernel thread)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int, procs: dict[int, Proc] | None = None) -> dict[int, Proc]:
    """Every live process below ``root`` (children, their children, ...), from one read of the table."""
    procs = table() if procs is None else procs
    children: dict[int, list[Proc]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c.pid not in out:
                out[c.pid] = c
                todo.append(c.pid)
    return out

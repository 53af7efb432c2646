"""A wall-clock step for one process, as an NTP step or a wrong RTC gives it (tests and benchmarks only).

:func:`build` compiles the LD_PRELOAD shim ``clock_step.c`` beside this module; a process started with
:meth:`Clock.env` in its environment reads its wall clock (CLOCK_REALTIME, ``time.time()``, hivemind's DHT
time) shifted by the offset in the clock's file, re-read at most once a second, while its monotonic clock
(asyncio's timers) runs on untouched. :meth:`Clock.step` changes the offset of a running process.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("clock_step.c")


def build(folder: Path) -> tuple[Path | None, str]:
    """The shim compiled into ``folder``, or None and why (no C compiler, or it failed)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc) for locomm/testing/clock_step.c"
    out = folder / "clock_step.so"
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"], capture_output=True)
    if done.returncode != 0:
        return None, f"cc failed: {done.stderr.decode(errors='replace')[-300:]}"
    return out, ""


@dataclass
class Clock:
    """One stepped clock: the shim and the file holding its offset in seconds (0 at first)."""

    shim: Path
    file: Path

    def __post_init__(self) -> None:
        self.step(0.0)

    def step(self, offset_s: float) -> None:
        """Set the offset from the real wall clock (not cumulative); processes see it within a second."""
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(f"{offset_s}\n")
        tmp.replace(self.file)

    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(self.shim), "LOCOMM_CLOCK_OFFSET_FILE": str(self.file)}

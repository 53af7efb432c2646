"""Single-node training figures: nano 300 steps (time, loss vs unigram) and tiny for ~5 minutes.

Runs ``locomm-peer train`` as a user would (a subprocess per run, measured with
its peak resident memory), prints a table and writes benchmarks/results/train.json.

    python benchmarks/train.py            # both runs (about 7 minutes on 2 cores)
    python benchmarks/train.py --only nano
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import _harness


def run(args: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "train", *args, "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"locomm-peer train {' '.join(args)} failed:\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    # Peak RSS of the largest child so far (the runs are sequential, so each later run's
    # figure is a max over it and the earlier ones; nano runs first and is far smaller).
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def tiny_steps_for(seconds: float) -> int:
    """Steps of tiny that take about ``seconds`` on this machine, from a short timed run."""
    probe = run(["--preset", "tiny", "--steps", "8"])
    tokens_per_step = 8 * 256
    return max(10, int(seconds * probe["tokens_per_s"] / tokens_per_step))


def main() -> None:
    ap = _harness.parser(__doc__, out="train.json", summary=True)
    ap.add_argument("--only", choices=["nano", "tiny"])
    ap.add_argument("--tiny-seconds", type=float, default=300.0)
    a = ap.parse_args()
    rows = []
    if a.only in (None, "nano"):
        r = run(["--preset", "nano", "--steps", "300"])
        rows.append(("nano", r))
    if a.only in (None, "tiny"):
        steps = tiny_steps_for(a.tiny_seconds)
        rows.append(("tiny", run(["--preset", "tiny", "--steps", str(steps)])))
    print(
        f"{'preset':8} {'steps':>6} {'wall s':>7} {'val nats/B':>10} {'bits/B':>7} {'unigram':>8} "
        f"{'vs unigram':>10} {'tok/s':>8} {'RSS MB':>7}"
    )
    for name, r in rows:
        print(
            f"{name:8} {r['steps']:6d} {r['process_wall_s']:7.1f} {r['val_loss']:10.4f} "
            f"{r['val_bits_per_byte']:7.3f} {r['unigram_nats']:8.4f} "
            f"{100 * (1 - r['val_loss'] / r['unigram_nats']):9.1f}% {r['tokens_per_s']:8.0f} "
            f"{r['peak_rss_mb']:7.0f}"
        )
    _harness.write_json(a.out, dict(rows), indent=2)
    print(json.dumps({name: r for name, r in rows}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

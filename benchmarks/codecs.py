"""Benchmark every codec against zstd-3 and lz4; see locomm/compression/bench.py.

python benchmarks/codecs.py            # rich table, 64 MB tensors + the tiny model's tensors
python benchmarks/codecs.py --quick    # 4 MB tensors + the nano model
python benchmarks/codecs.py --json > codecs.jsonl
"""

from __future__ import annotations

import argparse

from locomm.compression.bench import DEFAULT_CODECS, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--quick", action="store_true", help="small tensors, fewer repeats")
    ap.add_argument("--no-real", action="store_true", help="skip the model's tensors")
    ap.add_argument("--codecs", nargs="*", default=list(DEFAULT_CODECS), help="codec specs")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    run(json_lines=args.json, quick=args.quick, codecs=args.codecs, real=not args.no_real, repeats=args.repeats)


if __name__ == "__main__":
    main()

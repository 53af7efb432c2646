"""A volunteer's first swarm across two machines, with `join`'s defaults: two network namespaces on one bridge.

Host a runs ``locomm-peer join --new-swarm`` and host b ``locomm-peer join --initial-peers <a's address>``,
neither with ``--host-maddrs``: both listen on every interface on port 31337 (the default). Checks that a
logs the address others should use, that b joins through it, and how each partner's payload arrived (pushed
or pulled, over a direct connection or a relay: the ``exchange`` events). Needs root (netlab).

    sudo .venv/bin/python benchmarks/first_hour.py --out benchmarks/results/first_hour.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from locomm.testing import netlab


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    ok, why = netlab.available()
    if not ok:
        sys.exit(f"netlab unavailable: {why}")
    folder = Path(tempfile.mkdtemp(prefix="first-hour-"))
    join = [sys.executable, "-m", "locomm.cli.main", "join", "--until-round", str(args.rounds), "--device", "cpu"]
    result: dict[str, Any] = {"bench": "first_hour", "rounds": args.rounds}
    with netlab.Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        addr = folder / "a.addr"
        pa = a.popen(
            [*join, "--new-swarm", "--preset", "nano", "--wait-for-peers", "2", "-q"]
            + ["--log-file", str(folder / "a.jsonl"), "--announce-file", str(addr)],
            stdout=open(folder / "a.out", "w"),  # noqa: SIM115 - the child holds it
            stderr=open(folder / "a.err", "w"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 120
        while not (addr.exists() and addr.read_text().strip()):
            if pa.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"host a did not come up:\n{(folder / 'a.err').read_text()[-2000:]}")
            time.sleep(0.5)
        announced = addr.read_text().split()
        boot = next(m for m in announced if f"/ip4/{a.ip}/" in m)
        pb = b.popen(
            [*join, "--initial-peers", boot, "-q", "--log-file", str(folder / "b.jsonl")],
            stdout=open(folder / "b.out", "w"),  # noqa: SIM115
            stderr=open(folder / "b.err", "w"),  # noqa: SIM115
        )
        result["returncodes"] = [pa.wait(600), pb.wait(600)]
    result["announced"] = announced
    result["logged"] = [line.strip() for line in open(folder / "a.err") if "others join with" in line][:1]
    for name in "ab":
        events = [json.loads(line) for line in open(folder / f"{name}.jsonl")]
        fin = next((e for e in events if e["event"] == "finished"), {})
        result[name] = {
            "exchanges": [
                {k: e.get(k) for k in ("round", "via", "conn", "addrs")} for e in events if e["event"] == "exchange"
            ],
            "exchanges_ok": fin.get("exchanges_ok"),
            "initial_loss": fin.get("initial_loss"),
            "final_loss": fin.get("final_loss"),
        }
    result["all_direct"] = all(x["conn"] == "direct" for n in "ab" for x in result[n]["exchanges"])
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

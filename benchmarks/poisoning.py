"""Poisoning: 1 of 6 simulated workers sends poisoned outer updates; does the defence hold?

For each algorithm (NoLoCo, GASLoC, SparseLoCo) a clean run (6 honest workers) and one run per attack
(protocol/attacks.py: scale100, signflip, target, noise; worker 0 attacks, from its first round), with the
run spec's default ``[defence]``. Reported per run:

- the honest workers' (1..5) mean final validation loss, against the same workers in the clean run
  (goal: within 2%);
- the share of the attacker's exchanges (one honest receiver's settle of the attacker's update) that were
  rejected or clipped (goal: >= 95%);
- on clean runs, rejections and clips of honest updates (goal: 0).

``--undefended`` adds the same attacks with ``[defence] mode = "off"``, to show what each one does unchecked.

    python benchmarks/poisoning.py                    # nano, H=20, 10 rounds: ~15 min on 2 cores
    python benchmarks/poisoning.py --resume           # keep the runs already in the JSON
    python benchmarks/poisoning.py --algos noloco --attacks scale100 --rounds 4   # a quick look
"""

from __future__ import annotations

import math
import time

import torch
from algorithms import nano_spec

from locomm.config import RunSpec
from locomm.data import load_corpus
from locomm.protocol.attacks import ATTACKS
from locomm.sim import Simulator

import _harness

ALGOS = ["noloco", "gasloc", "sparseloco"]
WORKERS = 6
ATTACKER = 0


def run_one(spec: RunSpec, algo: str, attack: str | None, rounds: int, splits, defended: bool) -> dict:
    s = spec.replace("outer", algo=algo).replace("train", steps=rounds * spec.outer.inner_steps)
    if not defended:
        s = s.replace("defence", mode="off")
    # Evaluated at the start and the end only (the figures are final losses). codec "none": the default
    # parameter codec is lossless (bit-exact), so the numerics are the same and the CPU time is not spent
    # entropy-coding weights; SparseLoCo's payload is its own topk2bit encoding either way.
    sim = Simulator(
        s, WORKERS, splits=splits, codec="none", eval_every=rounds, attackers={ATTACKER: attack} if attack else None
    )
    t0 = time.perf_counter()
    res = sim.run(rounds)
    honest = [sim.trainers[w].evaluate() for w in range(WORKERS) if w != ATTACKER]
    d = dict(res.defence)
    ex = d.get("attacker_exchanges", 0)
    flagged = d.get("attacker_rejected", 0) + d.get("attacker_clipped", 0)
    return {
        "algo": algo,
        "attack": attack,
        "defended": defended,
        "honest_final_loss": sum(honest) / len(honest),
        "honest_losses": honest,
        "finite": all(math.isfinite(v) for v in honest),
        "val_loss_curve": res.val_loss,
        "defence": d,
        "attacker_flagged_share": flagged / ex if ex else None,
        "false_flags": d.get("honest_rejected", 0) + d.get("honest_clipped", 0),
        "real_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = _harness.parser(__doc__, out="poisoning.json", resume=True, summary=True)
    ap.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS)
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--undefended", action="store_true", help="Also run each attack with the defence off")
    a = ap.parse_args()
    torch.set_num_threads(2)
    spec = nano_spec(a.inner_steps)
    splits = load_corpus(spec.data)
    done = _harness.Entries(
        a.out,
        resume=a.resume,
        setup={
            "workers": WORKERS,
            "attacker": ATTACKER,
            "rounds": a.rounds,
            "inner_steps": a.inner_steps,
            "preset": "nano",
            "batch": [8, 128],
            "defence": spec.defence.__dict__,
        },
    )
    print(f"nano, {WORKERS} workers (worker {ATTACKER} attacks), H={a.inner_steps}, {a.rounds} rounds")
    for algo in a.algos:
        plan = [(None, True)] + [(k, True) for k in a.attacks]
        plan += [(k, False) for k in a.attacks] if a.undefended else []
        for attack, defended in plan:
            name = f"{algo}/{attack or 'clean'}" + ("" if defended else "/undefended")
            if name in done:
                continue
            r = run_one(spec, algo, attack, a.rounds, splits, defended)
            done.add(name, r)
            print(
                f"  {name:32s} honest loss {r['honest_final_loss']:.4f}  flagged {r['attacker_flagged_share']}"
                f"  false {r['false_flags']}  ({r['real_s']:.0f} s)",
                flush=True,
            )
    print()
    print(table(done.entries))
    print(f"wrote {a.out}")


def table(entries: dict) -> str:
    lines = [
        "| algo | attack | defence | honest loss | vs clean | attacker's exchanges rejected / clipped / total "
        "| flagged | false rejections / clips |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in entries.values():
        clean = entries.get(f"{r['algo']}/clean")
        rel = 100 * (r["honest_final_loss"] / clean["honest_final_loss"] - 1) if clean else math.nan
        d = r["defence"]
        att = [d.get(f"attacker_{k}", 0) for k in ("rejected", "clipped", "exchanges")]
        share = r["attacker_flagged_share"]
        lines.append(
            f"| {r['algo']} | {r['attack'] or 'clean'} | {'on' if r['defended'] else 'off'} | "
            f"{r['honest_final_loss']:.4f} | {rel:+.2f}% | "
            + (f"{att[0]} / {att[1]} / {att[2]} | {100 * share:.0f}% | " if share is not None else "- | - | ")
            + f"{d.get('honest_rejected', 0)} / {d.get('honest_clipped', 0)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

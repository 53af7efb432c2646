"""Seeded groups, matchings and graphs: every worker derives the same ones with no coordination.

All functions are pure: (seed, round index, sorted members) in, groups or graphs out.
A worker that knows the round's membership (from the DHT heartbeats, or the
simulator) computes the whole round's communication pattern locally.

- NoLoCo groups (docs/algorithms.md §2): ``perm = Permutation(seed=round+1)`` of the
  members; group j = {perm[j], perm[j + G], perm[j + 2G], ...} with
  G = max(1, N // n) groups. When n does not divide N, some groups get n + 1
  members, so nobody is left alone.
- GASLoC graphs (§3): a random perfect matching from the same permutation
  (pairs perm[2i], perm[2i+1]; with N odd the last worker joins the last pair),
  a ring in permutation order, k random peers per worker (edges made
  symmetric), or the complete graph; only the round's participants (each drawn
  with probability p) are in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _rng(seed: int, round_idx: int, salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, round_idx + 1, salt]))


def round_permutation(round_idx: int, members: Sequence[int], seed: int = 0) -> list[int]:
    """The round's permutation of the members (sorted first, so order of arrival does not matter)."""
    ordered = sorted(members)
    perm = _rng(seed, round_idx, 0x9E37).permutation(len(ordered))
    return [ordered[i] for i in perm]


def noloco_groups(round_idx: int, members: Sequence[int], group_size: int, seed: int = 0) -> list[list[int]]:
    """Disjoint groups of about ``group_size`` covering all members."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    perm = round_permutation(round_idx, members, seed)
    n_groups = max(1, len(perm) // group_size)
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    for pos, member in enumerate(perm):
        groups[pos % n_groups].append(member)
    return [sorted(g) for g in groups if g]


def group_of(me: int, groups: list[list[int]]) -> list[int]:
    for g in groups:
        if me in g:
            return g
    raise ValueError(f"worker {me} is not a member of this round")


def participants(round_idx: int, members: Sequence[int], p: float, seed: int = 0) -> list[int]:
    """Members that take part in the round's exchange, each with probability ``p`` (seeded per round)."""
    ordered = sorted(members)
    if p >= 1.0:
        return ordered
    draws = _rng(seed, round_idx, 0x5EED).random(len(ordered))
    return [m for m, u in zip(ordered, draws) if u < p]


def gasloc_graph(
    round_idx: int, members: Sequence[int], topology: str, *, k: int = 2, p: float = 1.0, seed: int = 0
) -> dict[int, set[int]]:
    """Undirected neighbour sets of the round's participants."""
    part = participants(round_idx, members, p, seed)
    nbrs: dict[int, set[int]] = {m: set() for m in part}
    if len(part) < 2:
        return nbrs
    perm = round_permutation(round_idx, part, seed)

    def link(a: int, b: int) -> None:
        if a != b:
            nbrs[a].add(b)
            nbrs[b].add(a)

    if topology == "matching":
        for i in range(0, len(perm) - 1, 2):
            link(perm[i], perm[i + 1])
        if len(perm) % 2:  # N odd (so N >= 3): the last worker joins the last pair, a triangle
            link(perm[-1], perm[-2])
            link(perm[-1], perm[-3])
    elif topology == "ring":
        for i in range(len(perm)):
            link(perm[i], perm[(i + 1) % len(perm)])
    elif topology == "kpeers":
        rng = _rng(seed, round_idx, 0x4B)
        ordered = sorted(part)
        for m in ordered:
            others = [o for o in ordered if o != m]
            for j in rng.choice(len(others), size=min(k, len(others)), replace=False):
                link(m, others[int(j)])
    elif topology == "complete":
        for a in part:
            for b in part:
                link(a, b)
    else:
        raise ValueError(f"unknown topology {topology!r}")
    return nbrs


def metropolis_weight(deg_i: int, deg_j: int) -> float:
    """Metropolis-Hastings edge weight: symmetric, so the mixing matrix is doubly stochastic."""
    return 1.0 / (1 + max(deg_i, deg_j))

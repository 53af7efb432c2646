"""The layout's own rules, checked where CI runs them: no import cycle in locomm, counting ``TYPE_CHECKING``
imports (a reader still has to hold them in their head); one concept per file, so a module's length follows its
concept: a warning above SOFT_LINES, a failure above HARD_LINES (more than one concept: split it at a seam, never
at a count).

The layering between packages is import-linter's (``.importlinter``, run by ``.ci/run``); a cycle inside a
package (two modules importing each other, a package and its submodule) is not a layering break, so it is
checked here, on the same import graph (grimp, import-linter's own).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2] / "locomm"
SOFT_LINES = 600
HARD_LINES = 800


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("locomm")  # TYPE_CHECKING imports count
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    graph = grimp.ImportGraph()
    for m in ("p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.b", imported="p.c")
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_module_length_follows_its_concept():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    for path, n in sorted(lines.items()):
        if n > SOFT_LINES:
            warnings.warn(f"{path}: {n} lines (over {SOFT_LINES}): is it still one concept?", stacklevel=1)
    assert {p: n for p, n in lines.items() if n > HARD_LINES} == {}


def test_readme_is_a_guide_of_at_most_200_lines_whose_test_command_ci_runs():
    repo = ROOT.parent
    readme = (repo / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md: at most 200 lines; the full tables live in docs/results/"
    ci = (repo / ".ci" / "run").read_text().splitlines()
    test_cmd = next(line for line in reversed(ci) if line.strip() and not line.startswith("#"))
    assert test_cmd in readme, f"the README's test command and .ci/run's differ: {test_cmd!r}"

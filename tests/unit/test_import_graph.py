"""No import loop inside ``speechbrain_fl.fl`` and ``speechbrain_fl.privacy``.

Every ``from .x import`` / ``from speechbrain_fl.<pkg>.x import`` of a module, at top level or
inside a function (a lazy import is still a dependency), is an edge; the graph must be acyclic.
Before: ``aggregation.get_rule`` imported ``layerwise`` lazily, which imported ``aggregation``
(the layer-wise rules registered themselves on import).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import speechbrain_fl

ROOT = Path(speechbrain_fl.__file__).parent


def _edges(package: str) -> dict[str, set[str]]:
    folder = ROOT / package
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {n: set() for n in names}
    for name in names:
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.module is None and node.level == 0:
                continue
            if node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
            elif (node.module or "").startswith(f"speechbrain_fl.{package}."):
                targets = [node.module.split(".")[2]]
            else:
                continue
            graph[name] |= {t.split(".")[0] for t in targets if t.split(".")[0] in names}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", ["fl", "privacy", "utils"])
def test_no_import_loop(package):
    assert _cycle(_edges(package)) is None, " -> ".join(_cycle(_edges(package)))


def test_layerwise_does_not_import_the_registry():
    code = (
        "import sys; import speechbrain_fl.fl.layerwise; "
        "assert 'speechbrain_fl.fl.aggregation' not in sys.modules; "
        "from speechbrain_fl.fl.aggregation import get_rule; "
        "assert get_rule('layerwise_samples').weighting == 'samples'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)

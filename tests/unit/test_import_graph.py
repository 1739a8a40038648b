"""No import loop inside ``speechbrain_fl.fl``, ``speechbrain_fl.privacy`` (subpackages included)
and ``speechbrain_fl.utils``.

Every ``from .x import`` / ``from speechbrain_fl.<pkg>.x import`` of a module, at top level or
inside a function (a lazy import is still a dependency), is an edge; the graph must be acyclic.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import speechbrain_fl

ROOT = Path(speechbrain_fl.__file__).parent


def _module_names(folder: Path) -> dict[str, Path]:
    """Dotted names inside the package (``accounting.pld``; a subpackage's ``__init__`` is its
    own name) -> file; the package's own ``__init__`` is left out."""
    names = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names[".".join(parts)] = path
    return names


def _resolve(name: str, path: Path, folder: Path, node: ast.ImportFrom, package: str) -> list[str]:
    """The dotted in-package names ``node`` imports (relative or ``speechbrain_fl.<package>.``)."""
    if node.level:
        here = list(path.relative_to(folder).parent.parts)
        base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
        prefix = ".".join(base + ([node.module] if node.module else []))
        if node.module:
            return [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        return [f"{prefix}.{a.name}" if prefix else a.name for a in node.names]
    if (node.module or "").startswith(f"speechbrain_fl.{package}."):
        mod = node.module[len(f"speechbrain_fl.{package}.") :]
        return [mod] + [f"{mod}.{a.name}" for a in node.names]
    return []


def _edges(package: str) -> dict[str, set[str]]:
    folder = ROOT / package
    names = _module_names(folder)
    graph: dict[str, set[str]] = {n: set() for n in names}
    for name, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for target in _resolve(name, path, folder, node, package):
                if target in names and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
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
    assert _edges(package), package
    assert _cycle(_edges(package)) is None, " -> ".join(_cycle(_edges(package)))


def test_layerwise_does_not_import_the_registry():
    code = (
        "import sys; import speechbrain_fl.fl.aggregate.layerwise; "
        "assert 'speechbrain_fl.fl.aggregate.rules' not in sys.modules; "
        "from speechbrain_fl.fl.aggregate.rules import get_rule; "
        "assert get_rule('layerwise_samples').weighting == 'samples'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)

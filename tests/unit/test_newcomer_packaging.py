"""Every third-party module the package, the recipes and the benchmarks import is declared in
``pyproject.toml`` (a dependency, or an extra for what only an optional part imports)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("speechbrain_fl", "recipes", "benchmarks")


def _imports() -> dict[str, set[str]]:
    """``{top-level module: {files}}`` of the absolute imports under :data:`SOURCES`."""
    found: dict[str, set[str]] = {}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def _local_modules() -> set[str]:
    """The recipes' and benchmarks' sibling modules (``import mls_prepare``) and the package."""
    names = {"speechbrain_fl"}
    for folder in ("recipes", "benchmarks"):
        names |= {p.stem for p in (ROOT / folder).rglob("*.py")}
    return names


def _declared() -> set[str]:
    """Normalised distribution names of the dependencies and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {_norm(re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0]) for spec in specs}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_third_party_module_is_declared():
    distributions = metadata.packages_distributions()
    local = _local_modules()
    declared = _declared()
    missing = {}
    for module, files in sorted(_imports().items()):
        if module in sys.stdlib_module_names or module in local or module == "__future__":
            continue
        # an optional part's module not installed here (pfl): its distribution has its name
        dists = {_norm(d) for d in distributions.get(module, [])} or {_norm(module)}
        if not dists & declared:
            missing[module] = (sorted(dists), sorted(files)[:2])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"

"""``constraints.txt`` pins every direct dependency, and the README names the pinned versions."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_direct_dependency_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    required = [*project["dependencies"], *extras["test"], *extras["tensorboard"]]
    names = {_name(r) for r in required} - {"speechbrain-fl"}
    missing = sorted(names - set(_pins()))
    assert not missing, f"constraints.txt pins no version of {missing}"


def test_the_readme_names_the_pinned_versions():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    tested = re.search(r"tested with (.*?)\.(?:\s|$)", text.replace("\n", " "))
    assert tested, "README.md: no 'tested with ...' sentence"
    named = dict(re.findall(r"([\w.-]+) (\d+\.\d+\.\d+)", tested.group(1)))
    pins = _pins()
    assert named and all(pins.get(k.lower()) == v for k, v in named.items()), (named, pins)

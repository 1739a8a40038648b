"""``tests/recipes/recipes.csv``: its rows, the run of one row and the grammar of its checks.

``recipes.csv`` holds one row per recipe hparams file, as SpeechBrain's
``tests/recipes/<Dataset>.csv``: the script, the hparams file, the ``--debug`` flags (with a
``{cache}`` placeholder for the session's cache folder of the recipe), the checks of its
outputs, and two optional columns:

- ``depends``: the id of a row that must run first and whose output folder this row shares
  (Private-Gender's student reads the teacher's outputs from ``<output_folder>/teacher``);
- ``marks``: pytest marks of the row's run, e.g. ``heavy`` for a run left out of the default
  test run and CI (``-m heavy`` runs it).

The fixtures that run rows once per session are in ``tests/recipes/conftest.py``.

The MLS rows run K = 4 clients for 2 debug rounds at ``--sampling_rate 0.9``: at the default
q = 0.3 a private run's OS-seeded Poisson cohorts are all empty with probability 0.7^8 ~ 6%,
and such a run has no group norms to plot (a flaky ``plots/group_norms.png`` check).
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RECIPES_CSV = Path(__file__).with_name("recipes.csv")
COLUMNS = ("recipe", "script", "hparams", "flags", "checks", "depends", "marks")
MARKS = ("slow", "heavy")


@dataclass(frozen=True)
class RecipeRow:
    """One row of ``recipes.csv``."""

    recipe: str
    script: str
    hparams: str
    flags: str
    checks: str
    depends: str = ""
    marks: str = ""

    @property
    def mark_names(self) -> list[str]:
        """The row's pytest marks (``marks`` split on spaces)."""
        return self.marks.split()

    @property
    def id(self) -> str:
        """``<recipe>/<hparams file stem>``, the pytest id of the row."""
        return f"{self.recipe}/{Path(self.hparams).stem}"


def load_rows(path: Path = RECIPES_CSV) -> list[RecipeRow]:
    """The rows of ``recipes.csv``; ``ValueError`` naming the file and row when malformed."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: header must be {','.join(COLUMNS)}, got {reader.fieldnames}")
        rows = []
        for line, row in enumerate(reader, start=2):
            if any(not row[c] for c in ("recipe", "script", "hparams")):
                raise ValueError(f"{path}, line {line}: recipe, script and hparams are required")
            rows.append(RecipeRow(**{c: row[c] or "" for c in COLUMNS}))
    ids = [r.id for r in rows]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"{path}: rows {duplicates} appear more than once")
    for row in rows:
        if row.depends and row.depends not in ids[: ids.index(row.id)]:
            raise ValueError(f"{path}: {row.id} depends on {row.depends!r}, not an earlier row")
        unknown = sorted(set(row.mark_names) - set(MARKS))
        if unknown:
            raise ValueError(f"{path}: {row.id}: unknown marks {unknown}; known: {MARKS}")
    return rows


ROWS = load_rows()


@dataclass(frozen=True)
class RecipeRun:
    """The outcome of one row: its output folder and the script's captured output."""

    row: RecipeRow
    output_folder: Path
    returncode: int
    stdout: str
    stderr: str


def run_script(row: RecipeRow, output_folder: Path, cache: Path, *extra: str, cwd=ROOT):
    """Run ``row``'s script on its hparams with its flags (``{cache}`` filled) in a subprocess.

    The hparams path is given relative to ``cwd`` (``hparams/x.yaml`` from the recipe folder),
    as a user would type it.
    """
    flags = [arg.replace("{cache}", str(cache)) for arg in shlex.split(row.flags)]
    hparams = os.path.relpath(ROOT / row.hparams, cwd)
    cmd = [sys.executable, str(ROOT / row.script), hparams, *flags,
           "--output_folder", str(output_folder), *extra]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


CHECK = re.compile(r"(\w+)=\[([^\]]*)\]")
KINDS = ("file_exists", "json_keys", "json_equals", "csv_rows", "stdout", "results")


def parse_checks(cell: str) -> dict[str, list[str]]:
    """``"file_exists=[a,b] stdout=[WER]"`` -> ``{"file_exists": ["a", "b"], "stdout": ["WER"]}``.

    Raises ``ValueError`` naming an unknown check kind or text that is not ``kind=[...]``.
    """
    checks: dict[str, list[str]] = {}
    for kind, items in CHECK.findall(cell):
        if kind not in KINDS:
            raise ValueError(f"unknown check {kind!r} in {cell!r}; known: {KINDS}")
        checks.setdefault(kind, []).extend(i.strip() for i in items.split(",") if i.strip())
    leftover = CHECK.sub("", cell).strip()
    if leftover:
        raise ValueError(f"cannot parse {leftover!r} in the checks {cell!r}")
    return checks


def results_file(checks: dict[str, list[str]]) -> str:
    """The JSON file the ``json_*`` checks read: ``results=[a/results.json]``, else results.json."""
    files = checks.get("results", [])
    if len(files) > 1:
        raise ValueError(f"results=[...] names one file, got {files}")
    return files[0] if files else "results.json"


def lookup(results: dict, dotted: str):
    """The value at a dotted key of a nested dict (``KeyError`` naming the key when absent)."""
    value = results
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(dotted)
        value = value[key]
    return value


# ------------------------------------------------------------------------------ bad inputs
BAD_INPUTS_CSV = Path(__file__).with_name("bad_inputs.csv")
BAD_COLUMNS = ("recipe", "script", "hparams", "flags", "expected")


@dataclass(frozen=True)
class BadInput:
    """One row of ``bad_inputs.csv``: a command the recipe must refuse before any work."""

    recipe: str
    script: str
    hparams: str
    flags: str
    expected: str

    @property
    def id(self) -> str:
        """``<recipe>/<hparams stem>: <flags>``, the pytest id of the row."""
        return f"{self.recipe}/{Path(self.hparams).stem}: {self.flags}"


def load_bad_inputs(path: Path = BAD_INPUTS_CSV) -> list[BadInput]:
    """The rows of ``bad_inputs.csv``; ``ValueError`` naming the file and line when malformed."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != BAD_COLUMNS:
            raise ValueError(
                f"{path}: header must be {','.join(BAD_COLUMNS)}, got {reader.fieldnames}"
            )
        rows = []
        for line, row in enumerate(reader, start=2):
            if any(not row[c] for c in BAD_COLUMNS):
                raise ValueError(f"{path}, line {line}: every column is required")
            rows.append(BadInput(**{c: row[c] for c in BAD_COLUMNS}))
    return rows


def run_bad_input(row: BadInput, tmp: Path) -> subprocess.CompletedProcess:
    """Run ``row``'s command with a fresh output and cache folder under ``tmp``."""
    cmd = [sys.executable, str(ROOT / row.script), row.hparams, *shlex.split(row.flags),
           "--output_folder", str(tmp / "out"), "--cache_folder", str(tmp / "cache")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------ faults
FAULTS_CSV = Path(__file__).with_name("faults.csv")
FAULT_COLUMNS = ("recipe", "script", "hparams", "flags", "fault", "target", "expected")
#: The faults a row may inject into a copy of the recipe's session cache before its run.
FAULTS = ("unreadable_train_file", "undecodable_train_file")
#: ``expected``: ``finishes:<results file>:<dotted key>`` (the run exits 0 and the key's value,
#: a list or mapping, names the file), ``counted:<results file>:<dotted key>`` (the run exits
#: 0 and the key's value is a count >= 1) or ``refused:<text>`` (one-line ``error:`` naming it).
OUTCOMES = ("finishes", "counted", "refused")


@dataclass(frozen=True)
class FaultRow:
    """One row of ``faults.csv``: a recipe run with a fault injected, and what must happen."""

    recipe: str
    script: str
    hparams: str
    flags: str
    fault: str
    target: str
    expected: str

    @property
    def id(self) -> str:
        """``<recipe>/<hparams stem>: <fault>``, the pytest id of the row."""
        return f"{self.recipe}/{Path(self.hparams).stem}: {self.fault}"

    @property
    def outcome(self) -> tuple[str, list[str]]:
        """``("finishes" | "counted", [results file, dotted key])`` or ``("refused", [text])``."""
        kind, _, rest = self.expected.partition(":")
        return kind, rest.split(":") if kind in ("finishes", "counted") else [rest]


def load_faults(path: Path = FAULTS_CSV) -> list[FaultRow]:
    """The rows of ``faults.csv``; ``ValueError`` naming the file and line when malformed."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != FAULT_COLUMNS:
            raise ValueError(
                f"{path}: header must be {','.join(FAULT_COLUMNS)}, got {reader.fieldnames}"
            )
        rows = []
        for line, row in enumerate(reader, start=2):
            fault = FaultRow(**{c: row[c] or "" for c in FAULT_COLUMNS})
            kind, parts = fault.outcome
            if fault.fault not in FAULTS:
                raise ValueError(f"{path}, line {line}: fault {fault.fault!r} not in {FAULTS}")
            if kind not in OUTCOMES or (kind != "refused" and len(parts) != 2):
                raise ValueError(
                    f"{path}, line {line}: expected {fault.expected!r} must be "
                    "finishes:<results file>:<key>, counted:<results file>:<key> or "
                    "refused:<text>"
                )
            if not fault.target:
                raise ValueError(f"{path}, line {line}: target (a glob in the cache) is required")
            rows.append(fault)
    return rows


def _listed(corpus: Path) -> set[str]:
    """Files a corpus's ``*_list.txt`` files name (Speech Commands' validation and test lists):
    not training files."""
    names: set[str] = set()
    for listing in corpus.glob("*_list.txt"):
        names |= {line.strip() for line in listing.read_text().splitlines() if line.strip()}
    return names


def inject_fault(row: FaultRow, cache: Path) -> Path:
    """Inject ``row.fault`` into the cache folder ``cache``; return the file it changed.

    The file is the first (sorted) matching ``row.target`` (a glob relative to ``cache``) that
    no ``*_list.txt`` of its corpus folder names. ``unreadable_train_file`` overwrites it with
    text, so that no audio library can open it; ``undecodable_train_file`` keeps its first 200
    bytes (the header, which still reads) and overwrites the rest with noise, so that it fails
    only when its frames are decoded, in training.
    """
    head = Path(row.target).parts[0]  # the corpus folder (a glob: its name carries a digest)
    corpus = next(iter(sorted(cache.glob(head))), cache / head)
    skip = _listed(corpus)
    for path in sorted(cache.glob(row.target)):
        if path.is_file() and path.relative_to(corpus).as_posix() not in skip:
            if row.fault == "undecodable_train_file":
                data = bytearray(path.read_bytes())
                noise = np.random.default_rng(0).integers(0, 256, len(data) - 200, np.uint8)
                data[200:] = noise.tobytes()
                path.write_bytes(bytes(data))
            else:
                path.write_text("this is not audio\n")
            return path
    raise FileNotFoundError(f"{row.id}: no training file matches {row.target!r} in {cache}")


def run_fault(row: FaultRow, output_folder: Path, cache: Path) -> subprocess.CompletedProcess:
    """Run ``row``'s script with its flags (``{cache}`` filled) on ``cache``."""
    recipe_row = RecipeRow(row.recipe, row.script, row.hparams, row.flags, "")
    return run_script(recipe_row, output_folder, cache)

"""The commands the READMEs and docs/ give, checked as written (checked as written).

Every fenced ```` ```bash ```` block of ``README.md``, ``recipes/*/README.md`` and ``docs/*.md``
is either

- **run by this file**: each line a recipe script command (``python recipes/<R>/<script>.py
  <hparams> [--key value ...]``), or
- **marked** by an HTML comment on the line before the fence, ``<!-- not-run: <reason> -->``
  (a GPU, real checkpoints or corpora, several machines or terminals, a network install); the
  reason names the test that runs the same commands on loopback or on generated data, where one
  exists.

What runs, and where:

- ``test_every_bash_block_is_run_or_marked`` (fast): a block that is neither fails, naming the
  file and line, so a new command cannot slip in untested;
- ``test_documented_recipe_commands_load`` (fast): every recipe command's hparams file and
  overrides load as written, with and without ``--debug`` (a renamed key fails here, naming it);
- ``test_documented_recipe_commands_run_in_debug_size`` (``heavy``, left out of CI): each
  block's recipe commands run in order with ``--debug`` appended, from a fresh temporary working
  directory (the script path anchored at the clone), on the embedded corpora from an empty
  cache (the default suite runs each recipe's ``--debug`` from an empty cache in
  ``test_debug_from_empty_cache.py`` and every hparams file in ``tests/recipes/recipes.csv``);
- ``test_console_examples_print_what_the_docs_show`` (fast): every ``$ speechbrain-fl ...`` line
  of a ```` ```console ```` block runs through the console script's ``main`` and prints the lines
  shown under it (``...`` elides).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted(ROOT.glob("recipes/*/README.md")),
    *sorted(ROOT.glob("docs/*.md")),
]
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")
RECIPE_COMMAND = re.compile(r"^python (?P<script>recipes/[\w-]+/[\w-]+\.py) (?P<args>hparams/.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and its not-run reason."""

    path: Path
    line: int
    lang: str
    text: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(paths=DOCS) -> list[Block]:
    """The fenced blocks of ``paths`` (with the ``not-run`` comment of the line before each)."""
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            match = re.match(r"^```(\w*)\s*$", lines[i])
            if not match:
                i += 1
                continue
            start, lang = i, match.group(1)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marked = NOT_RUN.match(before.strip())
            found.append(
                Block(path, start + 1, lang, "\n".join(lines[start + 1 : end]),
                      marked.group("reason") if marked else None)
            )  # fmt: skip
            i = end + 1
    return found


def commands(text: str) -> list[str]:
    """The shell commands of a block: continuations joined, comments and blank lines dropped."""
    joined, out = text.replace("\\\n", " "), []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            out.append(re.sub(r"\s+", " ", line))
    return out


def recipe_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, script, args)`` of every recipe command in a block that is run."""
    found = []
    for block in blocks():
        if block.lang != "bash" or block.not_run is not None:
            continue
        for command in commands(block.text):
            match = RECIPE_COMMAND.match(command)
            if match:
                found.append((block.where, match["script"], shlex.split(match["args"])))
    return found


def test_every_bash_block_is_run_or_marked():
    problems = []
    for block in blocks():
        if block.lang != "bash":
            continue
        if block.not_run is not None:
            if not block.not_run:
                problems.append(f"{block.where}: not-run without a reason")
            continue
        for command in commands(block.text):
            if not RECIPE_COMMAND.match(command):
                problems.append(f"{block.where}: {command!r} is not run here and not marked")
    assert not problems, "\n".join(problems)
    assert recipe_commands(), "no documented recipe command found"


def _overrides(args: list[str]) -> tuple[str, dict, dict]:
    """SpeechBrain's own parsing of a command line: (hparams file, run options, overrides)."""
    import speechbrain as sb
    import yaml

    hparams_file, run_opts, overrides = sb.parse_arguments(args)
    return hparams_file, run_opts, yaml.safe_load(overrides) if overrides else {}


@pytest.mark.parametrize("where, script, args", recipe_commands(), ids=lambda v: str(v)[:60])
def test_documented_recipe_commands_load(where, script, args):
    """The hparams file and every override of the command load, with and without --debug."""
    from speechbrain_fl.recipe import load_run_hparams

    hparams_file, run_opts, overrides = _overrides(args)
    recipe_dir = ROOT / Path(script).parent
    for debug in (False, True):
        try:
            hparams, _, _ = load_run_hparams(
                hparams_file, overrides, recipe_dir=recipe_dir, debug=debug
            )
        except (ValueError, FileNotFoundError) as err:
            pytest.fail(f"{where}: python {script} {' '.join(args)}: {err}")
        for key in overrides:
            assert key in hparams, f"{where}: {key} is not a key of {hparams_file}"
        assert "output_folder" in hparams


def _run_blocks() -> dict[str, list[tuple[str, list[str]]]]:
    """``{where: [(script, args), ...]}``: a block's commands run in order, in one directory
    (Private-Gender's student reads the teacher's outputs)."""
    grouped: dict[str, list[tuple[str, list[str]]]] = {}
    for where, script, args in recipe_commands():
        grouped.setdefault(where, []).append((script, args))
    return grouped


@pytest.mark.heavy
@pytest.mark.parametrize("where", sorted(_run_blocks()))
def test_documented_recipe_commands_run_in_debug_size(where, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for script, args in _run_blocks()[where]:
        proc = subprocess.run(
            [sys.executable, str(ROOT / script), *args, "--debug"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        command = f"python {script} {' '.join(args)} --debug"
        assert (
            proc.returncode == 0
        ), f"{where}: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _console_examples():
    """``(where, argv, expected lines)`` of every ``$ speechbrain-fl`` line of a console block."""
    found = []
    for block in blocks():
        if block.lang != "console":
            continue
        lines = block.text.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("$ speechbrain-fl "):
                continue
            expected = []
            for out in lines[i + 1 :]:
                if out.startswith("$ "):
                    break
                expected.append(out)
            argv = shlex.split(re.sub(r"\s+", " ", line[len("$ speechbrain-fl ") :]))
            found.append((block.where, argv, expected))
    return found


@pytest.mark.parametrize("where, argv, expected", _console_examples(), ids=lambda v: str(v)[:50])
def test_console_examples_print_what_the_docs_show(where, argv, expected):
    """The documented lines appear in the output, in order; ``...`` lines are elisions."""
    from speechbrain_fl import cli

    buffer = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # the docs' paths are relative to the clone
        with contextlib.redirect_stdout(buffer):
            assert cli.main(argv) == 0
    finally:
        os.chdir(cwd)
    actual = [line.rstrip() for line in buffer.getvalue().splitlines()]
    position = 0
    for line in expected:
        text = line.rstrip()
        if not text or text.lstrip().startswith("...") or text.endswith("..."):
            continue
        if "...," in text:  # an elided JSON list item
            continue
        try:
            position = actual.index(text, position) + 1
        except ValueError:
            pytest.fail(f"{where}: speechbrain-fl {' '.join(argv)}: {text!r} not printed")

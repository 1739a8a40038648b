"""The recipe kit's conventions: a script's entry point (``run_recipe``) and the preparation's
cache key (what ``prepare`` read, ``prepare_once``)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speechbrain_fl.recipe import (
    FederatedRecipe,
    InputRecorder,
    canonical,
    prepare_once,
    recipe_module,
)

ROOT = Path(__file__).resolve().parents[2]


def _counting(reads):
    """A preparation that reads ``reads`` (through a helper, ``get`` and ``in``) and counts."""
    calls = []

    def helper(hparams):
        return hparams["corpus_size"] * 2

    def prepare(hparams, run_opts):
        calls.append(1)
        out = {"size": helper(hparams), "debug": bool(run_opts.get("debug"))}
        for key in reads:
            out[key] = hparams.get(key) if key in hparams else None
        return out

    return prepare, calls


BASE = {"corpus_size": 4, "seed": 1, "number_of_rounds": 5, "noise_multiplier": 1.0}


def test_a_changed_preparation_input_prepares_again(tmp_path):
    prepare, calls = _counting(["seed"])
    first = prepare_once(tmp_path, prepare, hparams=BASE, run_opts={})
    assert first == {"size": 8, "debug": False, "seed": 1} and len(calls) == 1
    for key, value in (("corpus_size", 5), ("seed", 2)):
        prepare_once(tmp_path, prepare, hparams={**BASE, key: value}, run_opts={})
    assert len(calls) == 3
    prepare_once(tmp_path, prepare, hparams={**BASE, "seed": 2}, run_opts={"debug": True})
    assert len(calls) == 4  # a run option it read is an input too


def test_an_unrelated_key_does_not_prepare_again(tmp_path):
    prepare, calls = _counting(["seed"])
    prepare_once(tmp_path, prepare, hparams=BASE, run_opts={})
    changed = {**BASE, "number_of_rounds": 50, "noise_multiplier": 0.3, "new_key": [1]}
    assert prepare_once(tmp_path, prepare, hparams=changed, run_opts={"device": "cpu"})["seed"] == 1
    assert len(calls) == 1
    record = json.loads((tmp_path / "prepared.json").read_text())
    assert set(record["inputs"]["hparams"]) == {"corpus_size", "seed"}
    assert record["inputs"]["run_opts"] == {"debug": {"absent": True}}


def test_a_key_read_absent_then_given_prepares_again(tmp_path):
    prepare, calls = _counting(["workers"])
    prepare_once(tmp_path, prepare, hparams=BASE, run_opts={})
    prepare_once(tmp_path, prepare, hparams=BASE, run_opts={})
    prepare_once(tmp_path, prepare, hparams={**BASE, "workers": 2}, run_opts={})
    assert len(calls) == 2


def test_objects_are_keyed_by_what_they_hold_not_their_address(tmp_path):
    """A ``!name:`` factory (a partial) built again in another process is the same input."""
    calls = []

    def prepare(hparams):
        calls.append(hparams["model"].keywords["size"])
        return {}

    def make(size):
        return functools.partial(sorted, key=None, size=size)

    prepare_once(tmp_path, prepare, hparams={"model": make(3)})
    prepare_once(tmp_path, prepare, hparams={"model": make(3)})
    prepare_once(tmp_path, prepare, hparams={"model": make(4)})
    assert calls == [3, 4]
    assert canonical(object()) == "builtins:object"  # a repr with an address: its type


def test_iterating_the_hparams_makes_every_key_an_input():
    recorder = InputRecorder({"a": 1, "b": (2, 3)})
    assert dict(recorder) == {"a": 1, "b": (2, 3)}
    assert recorder.inputs == {"a": 1, "b": [2, 3]}


def test_a_write_during_the_preparation_reaches_the_callers_hparams():
    hparams = {"a": 1}
    recorder = InputRecorder(hparams)
    recorder["b"] = 2
    assert recorder["b"] == 2 and hparams["b"] == 2
    assert "b" not in recorder.inputs  # written before read: not an input


def test_a_damaged_record_prepares_again(tmp_path):
    prepare, calls = _counting([])
    (tmp_path / "prepared.json").write_text('{"key": {"seed": 1}, "result": {}}')  # other form
    prepare_once(tmp_path, prepare, hparams=BASE, run_opts={})
    assert len(calls) == 1


def test_federated_recipe_prepare_keys_on_what_make_reads(tmp_path):
    recipe = FederatedRecipe(recipe_dir=tmp_path, task_ref="x.py:task", check=lambda hp: None)
    hparams = {**BASE, "output_folder": str(tmp_path / "out"), "save_folder": str(tmp_path)}
    prepare, calls = _counting(["seed"])
    recipe.prepare(hparams, {}, make=prepare)
    recipe.prepare({**hparams, "number_of_rounds": 9}, {}, make=prepare)
    assert len(calls) == 1
    recipe.prepare({**hparams, "seed": 3}, {}, make=prepare)
    assert len(calls) == 2


SCRIPT = """
import sys
from pathlib import Path
from speechbrain_fl.recipe import Recipe, run_recipe

LOADS = []
LOADS.append(__name__)
RECIPE = Recipe(recipe_dir=Path(__file__).parent, check=lambda hp: None)


def main(run):
    print("main in", __name__, "value", run.hparams["value"], "folder on path",
          str(Path(__file__).parent) in sys.path)
    return run


if __name__ == "__main__":
    run_recipe(__file__)
"""


def test_run_recipe_runs_main_in_the_module_the_engine_imports(tmp_path):
    """``python script.py`` runs ``main`` in the script's one module (not ``__main__``), the
    one :func:`recipe_module` (and the engines' ``import_factory``) returns."""
    folder = tmp_path / "Toy"
    (folder / "hparams").mkdir(parents=True)
    (folder / "hparams" / "base.yaml").write_text(f"value: 1\noutput_folder: {tmp_path}/out\n")
    (folder / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(folder / "train.py"), "hparams/base.yaml", "--value", "2"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "main in Toy_train value 2 folder on path True" in proc.stdout
    module = recipe_module(folder / "train.py")
    assert module.__name__ == "Toy_train" and module is recipe_module(str(folder / "train.py"))
    run = module.RECIPE.run_script(["hparams/base.yaml"], module.main)
    assert run.hparams["value"] == 1 and run.started > 0


@pytest.mark.parametrize(
    ("row_id", "inputs", "not_inputs"),
    [
        ("MLS/fedavg", {"seed", "num_clients", "languages", "corpus_speakers_per_language"},
         {"number_of_rounds", "noise_multiplier", "sampling_rate", "method"}),
        ("SUPERB/kws", {"seed", "num_clients", "task", "corpus_options", "exits"},
         {"number_of_rounds", "noise_multiplier", "sampling_rate", "method"}),
    ],
)  # fmt: skip
def test_a_recipes_preparation_records_what_it_read(recipe_run, row_id, inputs, not_inputs):
    """A recipe's prepared.json lists the hparams its preparation read: the corpus, partition
    and model keys, not the federated ones (a change of those reuses the preparation)."""
    run = recipe_run(row_id)
    records = list(Path(run.output_folder).rglob("prepared.json"))
    assert records, f"no prepared.json under {run.output_folder}"
    read = set(json.loads(records[0].read_text())["inputs"]["hparams"])
    assert inputs <= read, sorted(inputs - read)
    assert not read & not_inputs, sorted(read & not_inputs)

"""The recipe kit (``speechbrain_fl.recipe``) on a toy recipe folder: fast, no run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from speechbrain_fl.recipe import (
    FederatedRecipe,
    RunSettings,
    cached_seed_model,
    prepare_once,
    prepared_with,
    resolve_hparams_path,
    save_prepare_options,
    update_readme_table,
)

BASE = """seed: 1
number_of_rounds: null
steps: 10
measure: True
value: 1
output_folder: !ref <tmp>/out
save_folder: !ref <output_folder>/save
tmp: .
"""


@pytest.fixture
def recipe_dir(tmp_path):
    (tmp_path / "hparams").mkdir()
    (tmp_path / "hparams" / "base.yaml").write_text(BASE.replace("tmp: .", f"tmp: {tmp_path}"))
    (tmp_path / "hparams" / "method.yaml").write_text("value: 2\n")
    return tmp_path


def _recipe(recipe_dir, calls):
    def check(hparams):
        calls.append(("check", hparams["number_of_rounds"], hparams["steps"]))
        if hparams["value"] < 0:
            raise ValueError(f"value: {hparams['value']} must be >= 0")

    def defaults(hparams):
        calls.append(("defaults", hparams["number_of_rounds"]))
        hparams["number_of_rounds"] = hparams["number_of_rounds"] or 5

    return FederatedRecipe(
        recipe_dir=recipe_dir, task_ref="x.py:task", default_hparams="hparams/method.yaml",
        check=check, defaults=defaults, debug_caps={"number_of_rounds": 2, "steps": 3},
        debug_values={"measure": False},
    )  # fmt: skip


def test_load_order_defaults_debug_then_checks(recipe_dir):
    calls = []
    recipe = _recipe(recipe_dir, calls)
    hparams, run_opts, base, merged = recipe.load("hparams/method.yaml", None, {"debug": True})
    # defaults, then again on the file loaded with the debug sizes; checks see the debug sizes
    assert calls == [("defaults", None), ("defaults", 2), ("check", 2, 3)]
    assert hparams["value"] == 2 and hparams["measure"] is False and run_opts == {"debug": True}
    # its own output folder, every !ref following it; the sizes in the saved overrides
    assert hparams["output_folder"] == f"{recipe_dir}/out_debug"
    assert hparams["save_folder"] == f"{recipe_dir}/out_debug/save"
    assert base.name == "base.yaml"
    assert merged == {
        "value": 2, "number_of_rounds": 2, "steps": 3, "measure": False,
        "output_folder": f"{recipe_dir}/out_debug",
    }  # fmt: skip
    # a folder named on the command line is the user's: --debug keeps it
    mine = f"{recipe_dir}/mine"
    hparams, _, _, merged = recipe.load("hparams/method.yaml", {"output_folder": mine},
                                        {"debug": True})  # fmt: skip
    assert hparams["output_folder"] == merged["output_folder"] == mine
    assert hparams["save_folder"] == f"{mine}/save"
    calls.clear()
    hparams, _, _, merged = recipe.load("hparams/method.yaml")
    assert calls == [("defaults", None), ("check", 5, 10)] and merged == {"value": 2}
    assert hparams["output_folder"] == f"{recipe_dir}/out"
    with pytest.raises(ValueError, match="value: -1 must be >= 0"):
        recipe.load("hparams/method.yaml", {"value": -1})
    with pytest.raises(ValueError, match=r"run option --compile is not supported"):
        recipe.load("hparams/method.yaml", None, {"compile": True})
    with pytest.raises(ValueError, match=r"\['value_typo'\] are not keys of"):
        recipe.load_for_task(None, {"value_typo": 3})


def test_hparams_path_working_directory_first_then_recipe_folder(recipe_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("cwd")
    (other / "hparams").mkdir()
    (other / "hparams" / "method.yaml").write_text("value: 3\n")
    cwd = os.getcwd()
    try:
        os.chdir(other)
        assert resolve_hparams_path("hparams/method.yaml", recipe_dir=recipe_dir).parent.parent == (
            other.resolve()
        )
        os.chdir(recipe_dir.parent)
        assert resolve_hparams_path("hparams/method.yaml", recipe_dir=recipe_dir).parent.parent == (
            recipe_dir.resolve()
        )
    finally:
        os.chdir(cwd)
    with pytest.raises(FileNotFoundError, match="hparams/none.yaml"):
        resolve_hparams_path("hparams/none.yaml", recipe_dir=recipe_dir)


def test_run_script_parses_locks_and_runs_main(recipe_dir):
    recipe = _recipe(recipe_dir, [])
    seen = {}

    def main(run):
        seen["rounds"] = run.hparams["number_of_rounds"]
        seen["experiment"] = run.experiment
        return "ran"

    argv = [str(recipe_dir / "hparams" / "method.yaml"), "--debug", "--steps", "7"]
    assert recipe.run_script(argv, main) == "ran"
    assert seen["rounds"] == 2
    assert seen["experiment"]["experiment_directory"] == f"{recipe_dir}/out_debug"
    assert seen["experiment"]["overrides"] == {
        "value": 2, "steps": 3, "number_of_rounds": 2, "measure": False,
        "output_folder": f"{recipe_dir}/out_debug",
    }  # fmt: skip


def test_the_factory_reuses_the_run_the_script_loaded(recipe_dir):
    """One load per process: a factory called with a run's spec gets that run's hparams."""
    calls = []
    recipe = _recipe(recipe_dir, calls)
    run = recipe.parse([str(recipe_dir / "hparams" / "method.yaml"), "--steps", "7"])
    assert calls.count(("check", 5, 7)) == 1
    for stage in (None, "profile"):
        spec = recipe.spec(run) if stage is None else recipe.spec(run, stage=stage)
        hparams, run_opts, got_stage = recipe.load_for_task(spec.hparams, dict(spec.overrides))
        assert hparams is run.hparams and run_opts == run.run_opts
        assert got_stage == (stage or "train")
    assert calls.count(("check", 5, 7)) == 1  # loaded and checked once
    # another process (no run remembered) loads the same values from the spec
    other = _recipe(recipe_dir, calls)
    hparams, _, _ = other.load_for_task(spec.hparams, dict(spec.overrides))
    assert hparams is not run.hparams and hparams["steps"] == run.hparams["steps"] == 7
    assert calls.count(("check", 5, 7)) == 2


def test_run_script_reports_a_user_error_in_one_line(recipe_dir, capsys):
    recipe = _recipe(recipe_dir, [])
    argv = [str(recipe_dir / "hparams" / "method.yaml"), "--value", "-1"]
    with pytest.raises(SystemExit) as exit_info:
        recipe.run_script(argv, lambda run: pytest.fail("main ran after a refused value"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("error: value: -1 must be >= 0") and "Traceback" not in err
    assert not (recipe_dir / "out").exists()  # refused before any work


def test_run_script_refuses_a_folder_another_process_holds(recipe_dir, capsys):
    import subprocess
    import sys

    out = recipe_dir / "out"
    out.mkdir()
    code = (
        "import sys, time; from speechbrain_fl.utils.run_lock import hold_run_lock\n"
        "with hold_run_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        recipe = _recipe(recipe_dir, [])
        with pytest.raises(SystemExit) as exit_info:
            recipe.run_script([str(recipe_dir / "hparams" / "method.yaml")], lambda run: "ran")
        assert exit_info.value.code == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # the OS released the lock with the process: the same run now goes ahead
    assert _recipe(recipe_dir, []).run_script([str(recipe_dir / "hparams" / "method.yaml")],
                                              lambda run: "ran") == "ran"  # fmt: skip


def test_prepare_once_and_options_record(tmp_path):
    calls = []

    def prepare(hparams):
        calls.append(hparams["splits"])
        return [1]

    result = prepare_once(tmp_path, prepare, hparams={"splits": ("a", "b")})
    assert prepare_once(tmp_path, prepare, hparams={"splits": ["a", "b"]}) == result
    assert calls == [("a", "b")]  # a tuple and a list are one key once written as JSON
    save_prepare_options(tmp_path, {"splits": ("a",)}, {"rows": 2})
    assert prepared_with(tmp_path, {"splits": ["a"]})
    assert not prepared_with(tmp_path, {"splits": ["a"]}, ["a.csv"])  # a manifest is missing
    (tmp_path / "prepare_options.json").write_text("{not json")
    assert not prepared_with(tmp_path, {"splits": ["a"]})


def test_seed_model_build_killed_leaves_nothing(tmp_path):
    def build(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed mid-build

    with pytest.raises(KeyboardInterrupt):
        cached_seed_model(cache_folder=tmp_path, prefix="seed", key={"a": 1}, build=build,
                          marker="config.json")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_run_settings_are_typed(tmp_path):
    settings = RunSettings(clients=["a.csv", "b.csv"], run_opts={"device": "cuda:0"})
    assert settings.num_clients == 2 and settings.device == "cuda:0"
    assert settings["clients"] == settings.clients
    with pytest.raises(KeyError, match="has no field 'client'"):
        settings["client"]
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['extra'\]"):
        RunSettings.from_dict({**settings.to_dict(), "extra": 1})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(settings.to_dict()))
    assert RunSettings.from_dict(json.loads(path.read_text())) == settings


def test_readme_table_markers(tmp_path):
    readme = Path(tmp_path / "README.md")
    readme.write_text("# R\n<!-- t:start -->\nold\n<!-- t:end -->\ntail\n")
    update_readme_table(readme, "t", "| a |")
    assert readme.read_text() == "# R\n<!-- t:start -->\n| a |\n<!-- t:end -->\ntail\n"
    with pytest.raises(ValueError, match=r"README\.md: no <!-- u:start --> marker"):
        update_readme_table(readme, "u", "| a |")


def test_partition_sizes_count_each_client_manifest(tmp_path):
    rows = {"a.csv": "ID,wav\n1,x.wav\n2,y.wav\n", "b.csv": "ID,wav\n"}
    for name, text in rows.items():
        (tmp_path / name).write_text(text)
    settings = RunSettings(clients=[str(tmp_path / name) for name in rows])
    assert settings.partition_sizes() == [2, 0]  # the server's bound on a reply's num-examples

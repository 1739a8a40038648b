"""The small rough edges a newcomer met: each now a clear message, with a test."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from speechbrain_fl import cli
from speechbrain_fl.fl.task import import_factory
from speechbrain_fl.recipe import load_run_hparams, timing_line

ROOT = Path(__file__).resolve().parents[2]


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("speechbrain-fl ") and out.split()[1][0].isdigit()


def test_cli_prints_the_accountants_warning_once(capsys, caplog):
    caplog.set_level(logging.WARNING)
    cli.main(["privacy", "--sampling-rate", "0.3", "--noise-multiplier", "0.1",
              "--rounds", "40", "--delta", "1e-5"])  # fmt: skip
    captured = capsys.readouterr()
    assert captured.out.count("exceeds 10") == 1  # in the output, once
    assert "exceeds 10" not in captured.err
    assert not [r for r in caplog.records if "exceeds 10" in r.getMessage()]  # not logged too


def _recipe(tmp_path):
    (tmp_path / "hparams").mkdir()
    (tmp_path / "hparams" / "base.yaml").write_text(
        "number_of_rounds: 10\noutput_folder: out\n", encoding="utf-8"
    )
    (tmp_path / "hparams" / "m.yaml").write_text("number_of_rounds: 5\n", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("debug", [False, True])
def test_a_non_number_for_a_debug_capped_key_is_named(tmp_path, debug):
    """``--number_of_rounds=abc --debug``: a ValueError naming the key, not min()'s TypeError
    (without --debug the recipe's own check names it, tests/recipes/bad_inputs.csv)."""
    d = _recipe(tmp_path)
    kwargs = {"recipe_dir": d, "debug": debug, "debug_caps": {"number_of_rounds": 2}}
    if not debug:
        hp, _, _ = load_run_hparams("hparams/m.yaml", "number_of_rounds: abc", **kwargs)
        assert hp["number_of_rounds"] == "abc"  # left to the recipe's check
        return
    with pytest.raises(ValueError, match=r"number_of_rounds: 'abc' must be a number"):
        load_run_hparams("hparams/m.yaml", "number_of_rounds: abc", **kwargs)


def test_a_script_task_module_has_a_readable_name(tmp_path):
    script = tmp_path / "MyRecipe" / "my_task.py"
    script.parent.mkdir()
    script.write_text(
        "import logging\nlogger = logging.getLogger(__name__)\n"
        "def factory(hparams=None, overrides=None):\n    return logger.name\n",
        encoding="utf-8",
    )
    try:
        assert import_factory(f"{script}:factory")() == "MyRecipe_my_task"
    finally:
        sys.modules.pop("MyRecipe_my_task", None)


def test_timing_line_says_when_the_parts_exceed_this_processs_total():
    assert timing_line({"data": 2, "training": 3, "total": 6}).endswith("total 6")
    line = timing_line({"corpus": 148, "federated": 2, "total": 9})
    assert "total 9 (this process; the parts include work of an earlier process" in line


def _transcribe():
    spec = importlib.util.spec_from_file_location(
        "mls_transcribe", ROOT / "recipes/MLS/transcribe.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transcribe_refuses_an_unknown_language_and_a_missing_wav(tmp_path, capsys):
    transcribe = _transcribe()
    wav = tmp_path / "a.wav"
    import numpy as np
    import soundfile

    soundfile.write(wav, np.zeros(1600, dtype="float32"), 16000)
    with pytest.raises(SystemExit) as exit_info:
        transcribe.main([str(tmp_path), str(wav), "--language", "klingon"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'klingon'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        transcribe.main([str(tmp_path), str(tmp_path / "missing.wav"), "--language", "english"])
    err = capsys.readouterr().err
    assert f"{tmp_path / 'missing.wav'}: no such file" in err and "Traceback" not in err
    (tmp_path / "notaudio.wav").write_text("hello", encoding="utf-8")
    with pytest.raises(SystemExit):
        transcribe.main([str(tmp_path), str(tmp_path / "notaudio.wav")])
    assert "notaudio.wav: not a readable audio file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the wav is fine, the checkpoint folder is not there
        transcribe.main([str(tmp_path / "no_model"), str(wav)])
    assert "no_model: no such folder" in capsys.readouterr().err

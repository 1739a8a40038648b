"""SUPERB recipe: every hparams file end to end in --debug on a small embedded corpus; bad input.

The debug runs start Ray and generate small espeak-ng corpora, so they are marked slow; the
bad-input checks fail before anything heavy and are fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "SUPERB"
sys.path.insert(0, str(RECIPE))

from superb_task import load_hparams  # noqa: E402

SMALL = {
    "kws.yaml": "{train_speakers: 4, valid_speakers: 1, test_speakers: 2, repeats: 1, "
    "unknown_words_per_speaker: 2, noise_seconds: 3}",
    "kws35.yaml": "{train_speakers: 2, valid_speakers: 1, test_speakers: 1, repeats: 1, "
    "noise_seconds: 3}",
    "sid.yaml": "{iden_speakers: 4, veri_speakers: 2, videos_per_speaker: 2, "
    "utterances_per_video: 3}",
    "asv.yaml": "{iden_speakers: 4, veri_speakers: 2, videos_per_speaker: 2, "
    "utterances_per_video: 3, trials_per_speaker: 2}",
    "er.yaml": "{sessions: 5, utterances_per_emotion: 1}",
    "asr.yaml": "{splits: {train-clean-100: 4, dev-clean: 1, test-clean: 1}, "
    "utterances_per_speaker: 3}",
}


def _run(hparams, tmp_path, *extra):
    cmd = [
        sys.executable, str(RECIPE / "train_fl.py"), f"hparams/{hparams}", "--debug",
        "--output_folder", str(tmp_path / "out"), "--cache_folder", str(tmp_path / "cache"),
        "--corpus_options", SMALL[hparams], "--num_clients", "2", "--pretrain_steps", "2",
        "--public_corpus_options", "{splits: {public: 2}, utterances_per_speaker: 2}", *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "out" / "results.json").read_text()), proc.stdout


# In CI: KWS (pooled heads) and ASR (CTC heads); the other files run with ``-m heavy``.
IN_CI = ("kws.yaml", "asr.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    "hparams",
    [h if h in IN_CI else pytest.param(h, marks=pytest.mark.heavy) for h in sorted(SMALL)],
)
def test_every_hparams_file_in_debug(hparams, tmp_path):
    results, stdout = _run(hparams, tmp_path)
    expected_exits = {"3", "6"} if hparams.startswith("kws") else {"3", "9"}
    assert set(results["test"]) == expected_exits  # every trained exit reported
    for entry in results["test"].values():
        lo, hi = entry["ci95"]
        value = entry["WER" if hparams == "asr.yaml" else "accuracy"]
        assert lo <= value <= hi
    assert {"task", "scenario", "aggregation", "weighting", "checkpoint", "memory_mb"} <= set(
        results
    )
    assert (tmp_path / "out" / "rounds.csv").is_file()
    assert (tmp_path / "out" / "plots" / "metric_by_round.png").is_file()
    assert "95% CI" in stdout  # the end-of-run results table
    if hparams == "asv.yaml":
        assert set(results["asv"]) == expected_exits
        assert 0.0 <= results["asv"]["9"]["EER"] <= 1.0


@pytest.mark.slow
@pytest.mark.heavy
def test_centralized_and_homogeneous_scenarios(tmp_path):
    results, _ = _run("kws.yaml", tmp_path / "c", "--scenario", "centralized", "--exit", "3")
    assert results["scenario"] == "centralized" and set(results["test"]) == {"3"}
    results, _ = _run(
        "kws.yaml", tmp_path / "h", "--scenario", "homogeneous", "--exit", "6",
        "--aggregation", "fedavg_full",
    )  # fmt: skip
    assert results["depths"] == [6, 6] and results["aggregation"] == "fedavg_full"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"task": "pos"}, "task: 'pos' must be one of"),
        ({"scenario": "solo"}, "scenario: 'solo' must be one of"),
        ({"exit": 5}, "exit: 5 is not one of the exits"),
        ({"aggregation": "median"}, "aggregation"),
        ({"weighting": "depth"}, "weighting"),
        ({"noise_multiplier": 1.0}, "private run is refused.*sensitivity"),
    ],
)
def test_bad_input_fails_before_anything_heavy(override, message):
    with pytest.raises(ValueError, match=message):
        load_hparams(RECIPE / "hparams" / "kws.yaml", override)


def test_depth_groups_reproduce_the_paper_split():
    from superb_task import client_depths

    hp, _, _ = load_hparams(RECIPE / "hparams" / "kws.yaml", {})
    depths = client_depths(hp, 12)
    assert sorted(depths) == [3] * 6 + [6] * 6  # 50% at exit 3, 50% at the task's best exit
    hp, _, _ = load_hparams(RECIPE / "hparams" / "er.yaml", {})
    assert sorted(client_depths(hp, 8)) == [3] * 4 + [9] * 4
    hp, _, _ = load_hparams(RECIPE / "hparams" / "kws.yaml", {"scenario": "homogeneous", "exit": 3})
    assert client_depths(hp, 4) == [3, 3, 3, 3]

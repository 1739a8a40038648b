"""SUPERB-only checks of the SUPERB recipe runs; bad input; the depth groups.

The generic debug run of every SUPERB hparams file is a row of ``tests/recipes/recipes.csv``
(run by ``tests/recipes/test_recipes.py``; KWS and ASR in CI, the others marked heavy). Here:
the per-exit results of the same runs (through the session fixture ``recipe_run``), the other
scenarios, and the checks that fail before anything heavy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.recipes.runner import ROWS, run_script

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "SUPERB"
sys.path.insert(0, str(RECIPE))

from superb_task import load_hparams  # noqa: E402

SUPERB_ROWS = {Path(row.hparams).name: row for row in ROWS if row.recipe == "SUPERB"}


def _run(hparams, tmp_path, recipe_cache, *extra):
    """A run of ``hparams``'s row with extra flags (its own output folder, the session cache)."""
    proc = run_script(SUPERB_ROWS[hparams], tmp_path / "out", recipe_cache("SUPERB"), *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "out" / "results.json").read_text()), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "hparams",
    [
        pytest.param(h, marks=[getattr(pytest.mark, m) for m in row.mark_names])
        for h, row in sorted(SUPERB_ROWS.items())
    ],
)
def test_every_exit_reported_with_its_ci(hparams, recipe_run):
    """The row's run (shared with test_recipes.py): every trained exit, a CI around each."""
    run = recipe_run(SUPERB_ROWS[hparams].id)
    results = json.loads((run.output_folder / "results.json").read_text())
    deep = {"kws.yaml": "6", "kws35.yaml": "12"}.get(hparams, "9")  # the files' best_exit
    expected_exits = {"3", deep}
    assert set(results["test"]) == expected_exits  # every trained exit reported
    for entry in results["test"].values():
        lo, hi = entry["ci95"]
        value = entry["WER" if hparams == "asr.yaml" else "accuracy"]
        assert lo <= value <= hi
    assert {"task", "scenario", "aggregation", "weighting", "checkpoint", "memory_mb"} <= set(
        results
    )
    if hparams == "asv.yaml":
        assert set(results["asv"]) == expected_exits
        assert 0.0 <= results["asv"]["9"]["EER"] <= 1.0


@pytest.mark.slow
@pytest.mark.heavy
def test_centralized_and_homogeneous_scenarios(tmp_path, recipe_cache):
    results, _ = _run(
        "kws.yaml", tmp_path / "c", recipe_cache, "--scenario", "centralized", "--exit", "3"
    )
    assert results["scenario"] == "centralized" and set(results["test"]) == {"3"}
    results, _ = _run(
        "kws.yaml", tmp_path / "h", recipe_cache, "--scenario", "homogeneous", "--exit", "6",
        "--aggregation", "fedavg_full",
    )  # fmt: skip
    assert results["depths"] == [6, 6] and results["aggregation"] == "fedavg_full"


@pytest.mark.slow
def test_secure_aggregation_matches_the_plaintext_run(tmp_path, recipe_cache, recipe_run):
    """SecAgg+ over the layer-wise rule: the server unmasks only sums, the model is the same.

    The debug kws row again with ``secure_aggregation: secaggplus``: results.json names the trust
    model, and every exit's test accuracy equals the plaintext row's up to one test utterance
    (the encoding's rounding, 2c/2^24 a coordinate, can move a borderline prediction at most).
    """
    plain = json.loads((recipe_run("SUPERB/kws").output_folder / "results.json").read_text())
    secure, _ = _run(
        "kws.yaml", tmp_path, recipe_cache,
        "--secure_aggregation", "secaggplus", "--secagg_clipping_range", "8.0",
    )  # fmt: skip
    assert secure["privacy"]["trust_model"]["name"] == "secure_aggregation"
    assert plain["privacy"]["trust_model"]["name"] == "central"
    n_test = sum(1 for _ in (tmp_path / "out" / "test_predictions.csv").open()) - 1
    assert set(secure["test"]) == set(plain["test"]) == {"3", "6"}
    for exit_, entry in secure["test"].items():
        assert abs(entry["accuracy"] - plain["test"][exit_]["accuracy"]) <= 1.0 / n_test + 1e-9


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"task": "pos"}, "task: 'pos' must be one of"),
        ({"scenario": "solo"}, "scenario: 'solo' must be one of"),
        ({"exit": 5}, "exit: 5 is not one of the exits"),
        ({"aggregation": "median"}, "aggregation"),
        ({"weighting": "depth"}, "weighting"),
        ({"noise_multiplier": 1.0}, "private run is refused.*sensitivity"),
        ({"shallow_clients": "all"}, "shallow_clients: 'all' must be one of"),
        ({"shallow_clients": "drop", "scenario": "centralized"}, "needs scenario: heterogeneous"),
        ({"lr_min_ratio": 1.5}, r"lr_min_ratio: 1.5 must be a number in \[0.0, 1.0\]"),
        ({"lr_warmup_fraction": 1.0}, r"lr_warmup_fraction: 1.0 must be a number in"),
        ({"backbone_lr_multiplier": -1}, "backbone_lr_multiplier: -1 must be a number >= 0"),
        ({"mask_time_length": 0}, "mask_time_length: 0 must be an integer >= 1"),
        ({"normalize_input": "yes"}, "normalize_input: 'yes' must be True, False or 'auto'"),
        ({"pretrain_objective": "mse"}, "must be 'none', 'bag_of_words', 'ctc' or 'phones'"),
        ({"pretrain_exits": [5]}, r"pretrain_exits: \[5\] must be a non-empty list of exits"),
        ({"phone_corpus": {"voices": 2}}, "phone_corpus: .* must map speakers and utterances"),
        ({"phone_corpus": {"speakers": 0}}, "phone_corpus: .* integers >= 1"),
        ({"pooling": "max"}, "pooling: 'max' must be 'stat' or 'mean'"),
        ({"upstream": "lora"}, "upstream: 'lora' must be 'finetune' or 'frozen'"),
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

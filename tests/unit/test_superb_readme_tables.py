"""The SUPERB README's tables and the root README's SUPERB row come from the results files."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB" / "studies"
sys.path.insert(0, str(STUDIES))


def test_readmes_agree_with_the_results_files():
    from readme_tables import differences

    assert differences() == [], "run recipes/SUPERB/studies/readme_tables.py"


def _copies(tmp_path):
    from readme_tables import README, RESULTS, ROOT_README

    results = tmp_path / "results"
    results.mkdir()
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, results)
    readme, root = tmp_path / "README.md", tmp_path / "ROOT.md"
    shutil.copy(README, readme)
    shutil.copy(ROOT_README, root)
    return results, readme, root


def test_a_changed_figure_is_caught_and_rewritten(tmp_path):
    from readme_tables import differences, write

    results, readme, root = _copies(tmp_path)
    path = results / "default.json"
    default = json.loads(path.read_text())
    first = sorted(default["test"], key=int)[0]
    default["test"][first]["accuracy"] += 0.1
    path.write_text(json.dumps(default))
    assert differences(readme, root, results) == ["results:superb-default", "root-row"]
    write(readme, root, results)
    assert differences(readme, root, results) == []
    assert f"{default['test'][first]['accuracy']:.3f}" in root.read_text()


def test_the_memory_table_names_the_measures_that_give_the_papers_order(tmp_path):
    from readme_tables import differences, memory_table

    results, readme, root = _copies(tmp_path)
    path = results / "memory_by_task.json"
    memory = json.loads(path.read_text())
    order = memory["paper_order_kws_sid_er_asr"]
    memory["paper_order_kws_sid_er_asr"] = dict.fromkeys(order, False)
    assert "holds under: none of the measures." in memory_table(memory)
    memory["paper_order_kws_sid_er_asr"] = {k: k == "peak_trained" for k in order}
    assert "holds under: peak, CNN trained." in memory_table(memory)
    path.write_text(json.dumps(memory))
    if memory["paper_order_kws_sid_er_asr"] != order:  # another verdict: the README is stale
        assert "results:superb-memory" in differences(readme, root, results)


def _fake_run(folder, exit_, seed, correct):
    """A centralized run's results.json and test_predictions.csv: clip i right if correct[i]."""
    folder.mkdir(parents=True)
    rows = ["ID,spk_id,label," + f"pred_{exit_}"]
    rows += [f"u{i},s{i % 4},yes,{'yes' if ok else 'no'}" for i, ok in enumerate(correct)]
    (folder / "test_predictions.csv").write_text("\n".join(rows) + "\n")
    accuracy = sum(correct) / len(correct)
    results = {"seed": seed, "test": {str(exit_): {"accuracy": accuracy, "ci95": [0, 1]}}}
    (folder / "results.json").write_text(json.dumps(results))
    return str(folder)


def test_a_depth_row_pools_the_seeds_and_pairs_the_clips(tmp_path):
    from readme_tables import depth_table, ingest_depth

    shallow = [
        _fake_run(tmp_path / f"e3_s{s}", 3, s, [i % 2 == 0 for i in range(8)]) for s in (1, 2)
    ]
    deep = [
        _fake_run(tmp_path / f"e12_s{s}", 12, s, [i % 4 != 3 for i in range(8)]) for s in (1, 2)
    ]
    row = ingest_depth("toy", ",".join(shallow), ",".join(deep), results=tmp_path)
    assert (row["seeds"], row["shallow"], row["deep"], row["deep_exit"]) == (2, 0.5, 0.75, 12)
    assert row["difference"][0] == 0.25 and row["difference"][1] <= 0.25 <= row["difference"][2]
    saved = json.loads((tmp_path / "depth_by_exit.json").read_text())
    assert saved["rows"] == [row]
    assert "| toy | 2 | 0.500 | 0.750 (exit 12) | +0.250 [" in depth_table(saved)
    with pytest.raises(ValueError, match="same seeds"):
        ingest_depth("toy", shallow[0], deep[1], results=tmp_path)


def _fake_arm(folder, seed, correct_by_exit, aggregation="layerwise"):
    """A federated run's results.json and test_predictions.csv with one column per exit."""
    folder.mkdir(parents=True)
    exits = sorted(correct_by_exit)
    n = len(correct_by_exit[exits[0]])
    rows = ["ID,spk_id,label," + ",".join(f"pred_{e}" for e in exits)]
    for i in range(n):
        preds = ",".join("yes" if correct_by_exit[e][i] else "no" for e in exits)
        rows.append(f"u{i},s{i % 4},yes,{preds}")
    (folder / "test_predictions.csv").write_text("\n".join(rows) + "\n")
    test = {str(e): {"accuracy": sum(c) / n, "ci95": [0, 1]} for e, c in correct_by_exit.items()}
    results = {"seed": seed, "task": "kws35", "rounds": 2, "aggregation": aggregation,
               "scenario": "heterogeneous" if len(exits) > 1 else "homogeneous", "test": test}  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results))
    return str(folder)


def test_table2_pools_the_arms_and_tests_the_pairs(tmp_path):
    from readme_tables import ingest_table2, table2

    right = [True] * 16
    half = [i < 8 for i in range(16)]  # 2 of the 4 clips of every speaker
    most = [i != 15 for i in range(16)]  # 4 of 4, speaker s3 3 of 4
    arms = {
        "homo": [_fake_arm(tmp_path / f"homo_{s}", s, {12: right}) for s in (1, 2)],
        "fedavg": [_fake_arm(tmp_path / f"fa_{s}", s, {3: half, 12: half}, "fedavg_full")
                   for s in (1, 2)],
        "layerwise": [_fake_arm(tmp_path / f"lw_{s}", s, {3: half, 12: most}) for s in (1, 2)],
    }  # fmt: skip
    data = ingest_table2(*(",".join(arms[k]) for k in ("homo", "fedavg", "layerwise")),
                         results=tmp_path)  # fmt: skip
    assert data["deep_exit"] == 12 and data["seeds"] == [1, 2]
    assert all(p["seeds"] == [1, 2] for p in data["pairs"])
    assert data["arms"]["layerwise"]["pooled"]["12"][0] == 0.9375
    assert data["arms"]["homogeneous"]["pooled"].get("3") is None
    pairs = {(p["a"], p["b"]): p for p in data["pairs"]}
    lw_fa = pairs[("layerwise", "fedavg_full")]
    # every (seed, speaker) unit favours layer-wise: exact sign-flip p = 2 / 2^8
    assert lw_fa["difference"][0] == 0.4375 and abs(lw_fa["p"] - 2 / 256) < 1e-9
    assert pairs[("layerwise", "homogeneous")]["difference"][0] == -0.0625
    text = table2(json.loads((tmp_path / "table2_kws35.json").read_text()))
    assert "| layer-wise - FedAvg | 1, 2 | +0.438 [" in text and text.endswith("): met.")
    # an arm short of a seed: its pairs use the seeds both arms ran
    data = ingest_table2(arms["homo"][0], ",".join(arms["fedavg"]), ",".join(arms["layerwise"]),
                         results=tmp_path)  # fmt: skip
    pairs = {(p["a"], p["b"]): p["seeds"] for p in data["pairs"]}
    assert pairs[("layerwise", "fedavg_full")] == [1, 2]
    assert pairs[("layerwise", "homogeneous")] == [1]
    assert "| - | 1.000 / - |" in table2(data)
    with pytest.raises(ValueError, match="no seed in common"):
        ingest_table2(arms["homo"][0], arms["fedavg"][1], arms["layerwise"][0], results=tmp_path)

"""studies/results_table.py: the grid of runs and the tables' layout, from fake results.json content."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
sys.path[:0] = [str(RECIPE), str(RECIPE / "studies")]

from results_table import (  # noqa: E402
    grid,
    paired_difference,
    pooled_accuracy,
    seeded,
    tables_markdown,
    write_readme,
)


def _result(values):
    return {
        "task": "kws12",
        "test": {str(e): {"accuracy": v, "ci95": [v - 0.1, v + 0.1]} for e, v in values.items()},
    }


def test_grid_covers_both_tables():
    names = [n for n, _ in grid(6, [1, 2])]
    assert {f"centralized_{e}" for e in (3, 6, 9, 12)} <= set(names)
    assert "homogeneous_6" in names and names.count("homogeneous_6") == 1
    assert "heterogeneous_fedavg_full" in names
    assert {n for n, _ in grid(6, [2])} == {
        "homogeneous_6",
        "homogeneous_3",
        "heterogeneous_deep_only",
        "heterogeneous_fedavg_full",
        "heterogeneous_layerwise_depth_aware",
        "heterogeneous_layerwise_samples",
        "heterogeneous_layerwise_uniform",
    }


def test_tables_markdown_and_readme_markers(tmp_path):
    values = {"centralized": {3: 0.5, 6: 0.6, 9: 0.55, 12: 0.4},
              "homogeneous": {3: 0.45, 6: 0.5, 9: 0.5, 12: 0.52}}  # fmt: skip
    results = {f"{s}_{e}": _result({e: v}) for s, row in values.items() for e, v in row.items()}
    results["heterogeneous_fedavg_full"] = _result({3: 0.3, 6: 0.4})
    results["heterogeneous_layerwise_depth_aware"] = _result({3: 0.6, 6: 0.7})
    text = tables_markdown(results, 6)
    # one row per exit; columns centralized | homogeneous FL | heterogeneous; best in bold
    assert "| 6 | **0.600 [0.500, 0.700]** | 0.500 [0.400, 0.600] | **0.700" in text
    assert "| 12 | 0.400 [0.300, 0.500] | **0.520 [0.420, 0.620]** | - |" in text
    assert "- homogeneous FL: exit 12 is the best exit" in text
    assert "- centralized: exit 6 - exit 12 = n/a" in text  # no per-clip predictions here
    assert "| heterogeneous + fedavg_full | 0.300 [0.200, 0.400] | 0.400 [0.300, 0.500] |" in text
    assert "layer-wise (depth_aware) | 0.600" in text and "uniform" not in text
    # the baselines of heterogeneous depth, when their runs exist
    results["heterogeneous_deep_only"] = _result({6: 0.45})
    text = tables_markdown(results, 6)
    assert (
        "| everyone at the weakest depth (homogeneous FL, exit 3) | 0.450 [0.350, 0.550] |" in text
    )
    assert "| deep clients only (the exit-3 clients dropped) | - | 0.450 [0.350, 0.550] |" in text
    assert "- minus deep clients only: n/a" in text
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- results:kws12:start -->\nold\n<!-- results:kws12:end -->\nb\n")
    write_readme("kws12", text, readme)
    content = readme.read_text()
    assert "\nold\n" not in content and "Table 2" in content and content.endswith("b\n")


def _predictions_run(folder, exit_, correct):
    """A run folder whose test_predictions.csv has ``correct[i]`` for clip i (speaker i // 4)."""
    folder.mkdir()
    lines = ["ID,spk_id,label,pred_" + str(exit_)]
    for i, ok in enumerate(correct):
        lines.append(f"c{i},s{i // 4},yes,{'yes' if ok else 'no'}")
    (folder / "test_predictions.csv").write_text("\n".join(lines) + "\n")
    return {"task": "kws12", "test": {}, "_folder": str(folder)}


def test_paired_difference_against_hand_values(tmp_path):
    # 3 speakers x 4 clips; A right on 10 clips, B on 6: difference 4/12
    a = _predictions_run(tmp_path / "a", 3, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0])
    b = _predictions_run(tmp_path / "b", 12, [1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0])
    diff, (lo, hi) = paired_difference(a, 3, b, 12, num_resamples=500)
    assert diff == pytest.approx(4 / 12)
    # per-speaker differences are 2/4, 2/4, 0/4: every resample lies in [0, 0.5]
    assert 0.0 <= lo <= diff <= hi <= 0.5
    same, (lo, hi) = paired_difference(a, 3, a, 3, num_resamples=200)
    assert same == 0.0 and lo == hi == 0.0
    c = _predictions_run(tmp_path / "c", 3, [1] * 8)
    with pytest.raises(ValueError, match="different clips"):
        paired_difference(a, 3, c, 3)


def test_seeded_grid_names_and_overrides():
    cells = seeded([("heterogeneous_deep_only", {"shallow_clients": "drop"})], [1, 2])
    assert cells == [
        ("heterogeneous_deep_only/s1", {"shallow_clients": "drop", "seed": 1}),
        ("heterogeneous_deep_only/s2", {"shallow_clients": "drop", "seed": 2}),
    ]
    assert dict(grid(6, [2]))["heterogeneous_deep_only"] == {"shallow_clients": "drop"}


def test_several_seeds_pool_clips_and_pair_by_seed_and_speaker(tmp_path):
    # seed 1: A right on 8 of 8 clips, B on 4; seed 2: A on 4 of 8, B on 4 (2 speakers each)
    a = [
        _predictions_run(tmp_path / "a1", 6, [1] * 8),
        _predictions_run(tmp_path / "a2", 6, [1, 1, 0, 0, 1, 1, 0, 0]),
    ]
    b = [_predictions_run(tmp_path / "b1", 6, [1, 1, 0, 0, 1, 1, 0, 0]),
         _predictions_run(tmp_path / "b2", 6, [1, 1, 0, 0, 1, 1, 0, 0])]  # fmt: skip
    value, (lo, hi) = pooled_accuracy(a, 6, num_resamples=300)
    assert value == pytest.approx(12 / 16) and 0.5 <= lo <= value <= hi <= 1.0
    diff, (lo, hi) = paired_difference(a, 6, b, 6, num_resamples=300)
    # per (seed, speaker) unit differences: 2/4, 2/4, 0, 0 -> mean 4/16; resamples in [0, 0.5]
    assert diff == pytest.approx(4 / 16) and 0.0 <= lo <= diff <= hi <= 0.5
    # the same clip ids in two seeds are two units, not one
    with pytest.raises(ValueError, match="different clips"):
        paired_difference(a, 6, b[:1], 6)


def test_table_2_per_seed_rows_and_differences(tmp_path):
    # two seeds; layer-wise right on 8/8 and 4/8 clips at exit 6, deep-only on 4/8 in both
    def run(name, seed, correct, exits=(3, 6)):
        r = {
            "task": "kws12",
            "seed": seed,
            "test": {str(e): {"accuracy": sum(correct) / 8, "ci95": [0, 1]} for e in exits},
            "_folder": str(tmp_path / name),
        }
        (tmp_path / name).mkdir()
        lines = ["ID,spk_id,label," + ",".join(f"pred_{e}" for e in exits)]
        for i, ok in enumerate(correct):
            lines.append(f"c{i},s{i // 4},yes," + ",".join(["yes" if ok else "no"] * len(exits)))
        (tmp_path / name / "test_predictions.csv").write_text("\n".join(lines) + "\n")
        return r

    half = [1, 1, 0, 0, 1, 1, 0, 0]
    results = {
        "heterogeneous_layerwise_depth_aware": [run("a1", 11, [1] * 8), run("a2", 12, half)],
        "heterogeneous_deep_only": [run("d1", 11, half, (6,)), run("d2", 12, half, (6,))],
    }
    text = tables_markdown(results, 6)
    assert "| Setting | seed 11 | seed 12 |" in text
    assert "| heterogeneous + layer-wise (depth_aware) | 1.000 / 1.000 | 0.500 / 0.500 |" in text
    assert "| deep clients only (the exit-3 clients dropped) | - / 0.500 | - / 0.500 |" in text
    # seed 11: every speaker +2/4, so the paired interval is the point; seed 12: identical runs
    assert "- minus deep clients only: seed 11 +0.500 [+0.500, +0.500]" in text
    assert "seed 12 +0.000 [+0.000, +0.000] (within speaker noise)" in text
    # a single seed has no per-seed block
    single = {k: v[0] for k, v in results.items()}
    assert "Per seed" not in tables_markdown(single, 6)

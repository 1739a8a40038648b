"""Run figures from synthetic rounds.csv / group_norms.csv (formats of docs/api.md)."""

import csv
import logging

import numpy as np
import pytest
from matplotlib.image import imread

from speechbrain_fl.plots import (
    component_color,
    effective_noise_curve,
    noise_floor,
    write_run_plots,
)
from speechbrain_fl.privacy import alpha_split_pools
from speechbrain_fl.run_outputs import component_labels, metric_columns, read_table

COMPONENTS = ("encoder", "connector", "llm")
BASE_COLUMNS = [
    "round", "cohort_size", "num_replied", "num_failed", "epsilon", "joint_norm_mean",
    "clip_rate", "mean_clip_ratio", "noise_std", "valid_loss", "WER",
]  # fmt: skip


def _write(path, header, rows):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


def _dp_run(folder, rounds=6):
    header = BASE_COLUMNS + [
        f"{p}{c}" for c in COMPONENTS for p in ("norm_", "clip_rate_", "budget_")
    ]
    rows = [{"round": 0, "cohort_size": "", "valid_loss": 3.0, "WER": 0.9}]
    for r in range(1, rounds):
        row = {
            "round": r, "cohort_size": 9, "num_replied": 9, "num_failed": 0,
            "epsilon": 0.4 * r, "joint_norm_mean": 3.0 / r, "clip_rate": 0.9 - 0.1 * r,
            "mean_clip_ratio": 0.3 + 0.1 * r, "noise_std": 0.01, "valid_loss": 3 - 0.3 * r,
            "WER": 0.9 - 0.1 * r,
        }  # fmt: skip
        for c, norm, budget in zip(COMPONENTS, (0.02, 0.5, 2.0), (0.224, 0.1, 0.97), strict=True):
            row |= {f"norm_{c}": norm / r, f"clip_rate_{c}": 0.5 / r, f"budget_{c}": budget}
        rows.append(row)
    _write(folder / "rounds.csv", header, rows)
    group_rows = []
    for r in range(1, rounds):
        for i, (c, scale) in enumerate(
            [("connector", 1.0)] + [("encoder", 0.01)] * 4 + [("llm", 0.15)] * 6
        ):
            group_rows.append(
                {"round": r, "group": f"g{i}", "component": c, "numel": 64 * (i + 1),
                 "mean_norm": scale * (1 + 0.1 * i) / r, "budget": 0.1, "clip_rate": 0.2}
            )  # fmt: skip
    _write(folder / "group_norms.csv", list(group_rows[0]), group_rows)


def _check_png(path):
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert float(image[..., :3].std()) > 0.05  # not a blank canvas
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 20


def test_dp_run_writes_all_figures(tmp_path):
    _dp_run(tmp_path)
    paths = write_run_plots(tmp_path, noise_multiplier=0.1, clip=1.0, alpha=0.05)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [
            "group_norms.png", "clipping_dynamics.png", "component_clipping.png",
            "metrics_by_round.png", "epsilon_by_round.png", "effective_noise.png",
        ]
    )  # fmt: skip
    for path in paths:
        assert path.parent == tmp_path / "plots"
        _check_png(path)


def test_fedavg_run_without_privacy_columns_skips_with_log(tmp_path, caplog):
    header = [
        "round",
        "cohort_size",
        "num_replied",
        "num_failed",
        "WER",
        "norm_encoder",
        "norm_llm",
    ]
    rows = [{"round": 0, "WER": 0.9}] + [
        {"round": r, "cohort_size": 5, "num_replied": 5, "num_failed": 0, "WER": 0.8 - 0.1 * r,
         "norm_encoder": 0.02, "norm_llm": 0.3}
        for r in range(1, 4)
    ]  # fmt: skip
    _write(tmp_path / "rounds.csv", header, rows)
    with caplog.at_level(logging.INFO, logger="speechbrain_fl.plots"):
        paths = write_run_plots(tmp_path, noise_multiplier=None, clip=None)
    assert [p.name for p in paths] == ["metrics_by_round.png"]
    _check_png(paths[0])
    log = caplog.text
    for skipped in ("group_norms.png", "clipping_dynamics.png", "epsilon_by_round.png",
                    "effective_noise.png", "component_clipping.png"):  # fmt: skip
        assert f"skipped {skipped}" in log


def test_missing_files_and_bad_cells(tmp_path):
    assert write_run_plots(tmp_path, noise_multiplier=0.0, clip=1.0) == []
    (tmp_path / "rounds.csv").write_text("round,WER\n0,0.9\n1,bad\n")
    with pytest.raises(ValueError, match=r"rounds\.csv: column 'WER', data row 2: 'bad'"):
        write_run_plots(tmp_path, noise_multiplier=0.1, clip=1.0)
    (tmp_path / "rounds.csv").write_text("WER\n0.9\n")
    with pytest.raises(ValueError, match="no 'round' column"):
        write_run_plots(tmp_path, noise_multiplier=0.1, clip=1.0)


def test_noise_floor_band_uses_mean_cohort_size(tmp_path):
    _dp_run(tmp_path)
    table = read_table(tmp_path / "rounds.csv")
    assert metric_columns(table) == ["valid_loss", "WER"]
    # Paper Fig. 2: sigma C / sqrt(n) ~= 0.01 for sigma=0.1, C=1, n=94.
    assert noise_floor(noise_multiplier=0.1, clip=1.0, expected_cohort_size=94) == pytest.approx(
        0.1 / np.sqrt(94)
    )
    with pytest.raises(ValueError, match="expected_cohort_size"):
        noise_floor(noise_multiplier=0.1, clip=1.0, expected_cohort_size=0)


def test_per_matrix_noise_norm_is_sigma_c_sqrt_p_over_n():
    """Eq. 4: N(0, (sigma C / n)^2 I) over a matrix of p values has norm ~ sigma C sqrt(p) / n."""
    sigma, c, n, p = 0.1, 1.0, 94.0, 10_240
    expected = sigma * c * np.sqrt(p) / n
    assert noise_floor(
        noise_multiplier=sigma, clip=c, expected_cohort_size=n, numel=p
    ) == pytest.approx(expected)
    # against a draw of the mechanism itself
    draws = np.random.default_rng(0).normal(0.0, sigma * c / n, size=(200, p))
    assert np.linalg.norm(draws, axis=1).mean() == pytest.approx(expected, rel=0.01)
    # Table I's encoder matrix: ~10x the paper's band sigma C / sqrt(n)
    band = noise_floor(noise_multiplier=sigma, clip=c, expected_cohort_size=n)
    assert 10 < expected / band < 11


def test_effective_noise_curve_matches_paper():
    # Section IV-A4: sigma = 0.1, alpha = 0.05 -> encoder 0.447 (4.47x), LLM 0.103 (+2.6%).
    curve = effective_noise_curve(0.1, [0.05, 0.5])
    assert curve["encoder"][0] == pytest.approx(0.4472, abs=1e-4)
    assert curve["llm"][0] == pytest.approx(0.1026, abs=1e-4)
    assert curve["encoder"][1] == pytest.approx(curve["llm"][1])
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        effective_noise_curve(0.1, [0.0])


def test_component_labels_come_from_the_files_not_a_fixed_list(tmp_path):
    """A SUPERB-like layout (layers and exits): every figure is drawn, colors follow file order."""
    labels = ("layer1", "layer2", "exit1")
    header = BASE_COLUMNS + [f"{p}{c}" for c in labels for p in ("norm_", "clip_rate_", "budget_")]
    rows = [{"round": 0, "valid_loss": 3.0}]
    for r in range(1, 4):
        row = {"round": r, "cohort_size": 4, "joint_norm_mean": 1.0 / r, "epsilon": 0.3 * r,
               "clip_rate": 0.5, "valid_loss": 3 - r * 0.5}  # fmt: skip
        row |= {f"{p}{c}": 0.1 * (i + 1) / r for i, c in enumerate(labels) for p in
                ("norm_", "clip_rate_", "budget_")}  # fmt: skip
        rows.append(row)
    _write(tmp_path / "rounds.csv", header, rows)
    groups = [
        {"round": r, "group": f"g{i}", "component": c, "mean_norm": 0.1 * (i + 1)}
        for r in (1, 2, 3)
        for i, c in enumerate(labels)
    ]
    _write(tmp_path / "group_norms.csv", list(groups[0]), groups)
    paths = write_run_plots(tmp_path, noise_multiplier=0.1, clip=1.0)
    assert len(paths) == 6
    table = read_table(tmp_path / "rounds.csv")
    assert component_labels(table, "budget") == list(labels)
    assert [component_color(c, labels) for c in labels] == ["tab:blue", "tab:orange", "tab:green"]


def test_effective_noise_curve_is_keyed_by_the_alpha_split_pools():
    pools = alpha_split_pools(0.3)
    curve = effective_noise_curve(0.2, [0.3])
    assert list(curve) == ["alpha", *(p.name for p in pools)]
    for pool in pools:
        assert curve[pool.name][0] == pytest.approx(0.2 / np.sqrt(pool.fraction))

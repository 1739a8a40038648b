"""The MLS figures have one source: the READMEs' results equal what the results files give."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "MLS" / "studies" / "readme_results.py"


@pytest.fixture(scope="module")
def readme_results():
    spec = importlib.util.spec_from_file_location("mls_readme_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readmes_equal_the_results_files(readme_results):
    """Regenerate in memory: the recipe README's block and the root README's MLS row."""
    differ = readme_results.update(check=True)
    assert differ == [], (
        f"{differ} differ from recipes/MLS/studies/measured/: run "
        "python recipes/MLS/studies/readme_results.py write"
    )


def test_the_block_carries_the_results_files_figures(readme_results):
    main = {
        "command": "python recipes/MLS/train_fl.py hparams/alpha_split.yaml",
        "method": "alpha_split", "test_wer": 0.61234, "test_wer_ci95": [0.55, 0.66],
        "round0_wer": 0.8, "change": -0.188, "change_ci95": [-0.25, -0.12], "change_p": 0.0001,
        "significant": True, "epsilon": 1.234, "delta": 1e-6, "sampling_rate": 0.01,
        "timings_s": {"total": 555.0, "corpus": 40.0, "federated": 400.0},
    }  # fmt: skip
    grid = {
        "seeds": [11, 12],
        "rows": [{"method": "flat", "name": "Flat", "wers": [0.6, 0.62], "wer_pooled": 0.61, "change": -0.2,
                  "change_ci": [-0.3, -0.1], "ce": [1.0, 1.2]}],
        "pairs": [{"a": "pfl_uniform", "b": "flat", "seeds": 2, "difference": 0.05,
                   "ci95": [0.01, 0.09], "p": 0.02, "significant": True}],
    }  # fmt: skip
    block = readme_results.recipe_block(main, grid)
    assert "0.800 at round 0 -> 0.612" in block and "ε = 1.23" in block and "555 s" in block
    assert (
        "| Flat | 0.1685 | 0.1959\\* | 0.600 / 0.620 | 0.610 | -0.200 [-0.300, -0.100] "
        "| 1.100 ± 0.141 (mean ± sd) |" in block
    )
    assert "| PFL-Uniform | 0.4643 | 0.9944† | not run |" in block
    assert "| PFL-Uniform - Flat | 2 | +0.050 [+0.010, +0.090] | 0.020 | yes | - | - |" in block
    assert "- PFL-Uniform significantly worse than Flat: **met**" in block
    assert "- FedAvg at or below Flat: **not measured**" in block
    assert "gap to the ceiling (CI above it): **not measured**" in block
    # per-utterance CE files give the CE its CI; the ceiling gives its row and the closure
    grid["rows"][0].update(ce_pooled=0.19, ce_ci=[0.17, 0.21])
    grid["pairs"][0]["ce"] = {
        "difference": 0.03,
        "ci95": [0.01, 0.05],
        "p": 0.004,
        "significant": False,
    }
    grid["ceiling"] = {
        "seeds": [11, 12], "wers": [0.5, 0.52], "wer_pooled": 0.51, "change": -0.3,
        "change_ci": [-0.35, -0.25], "ce_pooled": 0.15, "ce_ci": [0.14, 0.16],
        "wer_round0": 0.81, "wer_fedavg": 0.6, "central_minus_fedavg": -0.09,
        "central_minus_fedavg_ci": [-0.12, -0.06], "closure": 0.7, "closure_ci": [0.66, 0.74],
    }  # fmt: skip
    block = readme_results.recipe_block(main, grid)
    assert "| -0.200 [-0.300, -0.100] | 0.190 [0.170, 0.210] |" in block
    assert "| yes | +0.030 [+0.010, +0.050] | 0.004 |" in block
    assert "than Flat: **met** on test WER; **not met** on test CE" in block
    assert (
        "| Central ceiling (pooled client data, no DP) | - | - | 0.500 / 0.520 | 0.510 "
        "| -0.300 [-0.350, -0.250] | 0.150 [0.140, 0.160] |" in block
    )
    assert "FedAvg closes 70% [66%, 74%] of the gap" in block
    assert "gap to the ceiling (CI above it): **met**" in block
    grid["ceiling"]["closure_ci"] = [0.6, 0.8]
    assert "(CI above it): **not met**" in readme_results.recipe_block(main, grid)
    row = readme_results.root_row(main, grid)
    assert (
        "Flat 0.610; central ceiling 0.510 (FedAvg closes 70% of the gap from round 0 0.810)" in row
    )
    row = readme_results.root_row(main, grid)
    assert row.startswith(readme_results.ROW_PREFIX) and "Flat 0.610" in row
    assert "0.800 at round 0 -> 0.612 [0.550, 0.660]" in readme_results.main_line(main)
    main["simulated_deployment"] = {"population": 100000}
    main["machine"] = "2 CPU cores, nothing else running"
    text = readme_results.quickstart(main)
    assert text.startswith(readme_results.QUICKSTART_PREFIX) and "9.2 minutes" in text
    assert "100,000 clients" in text and "(2 CPU cores, nothing else running)" in text


def test_markers_are_required(readme_results):
    with pytest.raises(ValueError, match="needs exactly one"):
        readme_results.replace_between("no markers", readme_results.MARKERS, "x", where="R")
    with pytest.raises(ValueError, match="needs exactly one paragraph"):
        readme_results.replace_paragraph("text", "The main job", "x", where="R")
    text = "a\nThe main job x\ny\n\nnext"
    assert readme_results.replace_paragraph(text, "The main job", "NEW", where="R") == (
        "a\nNEW\n\nnext"
    )
    with pytest.raises(ValueError, match="needs exactly one line"):
        readme_results.replace_row("| SUPERB | a |", "| MLS | b |", where="R")

"""Run outputs: the results table printed at the end of a run (and written into recipe
READMEs) and the readers of rounds.csv / group_norms.csv."""

import pytest

from speechbrain_fl.run_outputs import (
    format_results_table,
    mean_cohort_size,
    read_group_norms,
    read_rounds,
    results_rows,
)

ALPHA = {
    "method": "alpha_split",
    "model": "tiny",
    "test": {"WER": 0.41, "WER_ci95": [0.38, 0.44], "per_language": {"de": {"WER": 0.4}}},
    "privacy": {
        "epsilon": 7.9, "delta": 1e-5, "noise_multiplier": 0.1, "clip": 1.0,
        "sampling_rate": 0.3, "rounds": 40, "sigma_eff": {"encoder": 0.447, "llm": 0.103},
    },
}  # fmt: skip
FEDAVG = {"method": "fedavg", "model": "tiny", "test": {"WER": 0.3, "per_language": {"fr": 0.2}}}


def test_markdown_rows_union_languages_and_blank_privacy():
    table = format_results_table([ALPHA, FEDAVG])
    lines = table.splitlines()
    assert lines[0].startswith("| Method | Model | WER | 95% CI | WER de | WER fr | ε |")
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| alpha_split | tiny | 0.4100 | [0.3800, 0.4400] | 0.4000 | - | 7.90 |" in table
    assert "0.447 | 0.103 |" in lines[2]
    assert lines[3].startswith("| fedavg | tiny | 0.3000 | - | - | 0.2000 | - |")


def test_text_style_and_errors():
    text = format_results_table(ALPHA, style="text")
    header, row = text.splitlines()
    assert header.index("WER de") == row.index("0.4000")
    with pytest.raises(ValueError, match=r"results\[1\] \('broken'\) has no test.WER"):
        results_rows([ALPHA, {"method": "broken", "test": {}}])
    with pytest.raises(ValueError, match="style must be"):
        format_results_table(ALPHA, style="html")


def test_sigma_eff_columns_are_the_union_of_the_runs_pools():
    layers = {"method": "pfl_dim", "test": {"WER": 0.5},
              "privacy": {"sigma_eff": {"layer1": 0.12, "exit1": 0.3}}}  # fmt: skip
    header, rows = results_rows([ALPHA, layers, FEDAVG])
    pools = [h for h in header if h.startswith("σ_eff")]
    assert pools == ["σ_eff encoder", "σ_eff llm", "σ_eff layer1", "σ_eff exit1"]
    assert rows[1][-4:] == ["-", "-", "0.120", "0.300"]
    assert rows[2][-4:] == ["-"] * 4


def test_readers_of_the_csv_files(tmp_path):
    assert read_rounds(tmp_path) is None and read_group_norms(tmp_path) is None
    (tmp_path / "rounds.csv").write_text("round,cohort_size\n0,\n1,4\n2,6\n")
    assert mean_cohort_size(read_rounds(tmp_path)) == 5.0
    (tmp_path / "group_norms.csv").write_text("round,group,component\n1,g,enc\n")
    with pytest.raises(ValueError, match=r"group_norms\.csv: missing column\(s\) \['mean_norm'\]"):
        read_group_norms(tmp_path)
    (tmp_path / "rounds.csv").write_text("WER\n0.5\n")
    with pytest.raises(ValueError, match="no 'round' column"):
        read_rounds(tmp_path)

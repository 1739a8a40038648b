"""The results table printed at the end of a run and written into recipe READMEs."""

import pytest

from speechbrain_fl.metrics.results_table import format_results_table, results_rows

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

"""Pool statistics of a run: per-matrix and per-coordinate norm ratios, retention (Fig. 5)."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from speechbrain_fl.fl.dp.profile import pool_norms, pool_retention
from speechbrain_fl.privacy import Group, Layout
from speechbrain_fl.privacy.budgets import compute_budgets

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "MLS"))
import mls_report  # noqa: E402

# encoder: two 100-value matrices; LLM pool: one 400-value LLM matrix and a 25-value connector
LAYOUT = Layout(
    [
        Group("e1", "encoder", 100),
        Group("e2", "encoder", 100),
        Group("l1", "llm", 400),
        Group("c", "connector", 25),
    ]
)


def test_equal_per_coordinate_moves_give_ratio_one_per_coordinate():
    """An AdamW-like update (every coordinate moved by the same amount) has norms ~ sqrt(p)."""
    step = 0.01
    norms = {g.name: step * math.sqrt(g.numel) for g in LAYOUT}
    out = pool_norms(norms, LAYOUT)
    assert out["ratio_per_coordinate"] == pytest.approx(1.0)
    # per matrix the large LLM matrix looks larger: (0.2 + 0.05) / 2 against 0.1
    assert out["ratio_per_matrix"] == pytest.approx(1.25)


def test_per_coordinate_norm_is_pool_norm_over_sqrt_p():
    norms = {"e1": 0.3, "e2": 0.4, "l1": 1.2, "c": 0.5}
    out = pool_norms(norms, LAYOUT)
    assert out["per_coordinate_norm"]["encoder"] == pytest.approx(0.5 / math.sqrt(200))
    assert out["per_coordinate_norm"]["llm"] == pytest.approx(1.3 / math.sqrt(425))
    assert out["per_matrix_mean_norm"] == pytest.approx({"encoder": 0.35, "llm": 0.85})


def test_flat_retention_is_the_mean_clip_ratio_for_every_pool():
    report = SimpleNamespace(
        group_norms={"e1": 1.0, "e2": 1.0, "l1": 2.0, "c": 0.1}, group_budgets={},
        mean_clip_ratio=0.4,
    )  # fmt: skip
    assert pool_retention(report, LAYOUT) == {"encoder": 0.4, "llm": 0.4}


def test_per_group_retention_against_a_direct_clip():
    """Retention of each pool equals clipping one client's update by hand (one client)."""
    norms = {"e1": 0.05, "e2": 0.5, "l1": 2.0, "c": 0.1}
    budgets = compute_budgets(LAYOUT, method="pfl_uniform", clip=1.0)
    report = SimpleNamespace(group_norms=norms, group_budgets=budgets, mean_clip_ratio=None)
    got = pool_retention(report, LAYOUT)
    c = 1.0 / math.sqrt(4)
    enc = math.hypot(min(0.05, c), min(0.5, c)) / math.hypot(0.05, 0.5)
    llm = math.hypot(min(2.0, c), min(0.1, c)) / math.hypot(2.0, 0.1)
    assert got == pytest.approx({"encoder": enc, "llm": llm})
    # the uniform budget starves the large LLM matrix: it keeps a quarter of its norm
    assert got["llm"] < 0.3 < got["encoder"]


def test_pool_summary_averages_rounds():
    rounds = [
        SimpleNamespace(group_norms={"e1": 0.1, "e2": 0.1, "l1": 1.0, "c": 0.0}, group_budgets={},
                        mean_clip_ratio=r)
        for r in (0.5, 1.0)
    ]  # fmt: skip
    out = mls_report.pool_summary(rounds, LAYOUT)
    assert out["rounds"] == 2 and out["retention"] == {"encoder": 0.75, "llm": 0.75}
    assert out["ratio_per_coordinate"] == pytest.approx(
        (1.0 / math.sqrt(425)) / (math.hypot(0.1, 0.1) / math.sqrt(200))
    )
    assert mls_report.pool_summary([SimpleNamespace(group_norms={})], LAYOUT) is None

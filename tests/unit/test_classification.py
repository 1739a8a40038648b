"""Classification metrics and their speaker-level bootstrap, against hand and brute-force values."""

import itertools

import numpy as np
import pytest

from speechbrain_fl.metrics.classification import (
    accuracy,
    balanced_accuracy,
    bootstrap_classification,
    macro_f1,
)

# Rows = true class, columns = predicted class.
CONFUSION = np.array([[5, 1, 0], [2, 3, 1], [0, 0, 4]], dtype=float)


def test_metrics_on_a_known_confusion_matrix():
    assert accuracy(CONFUSION) == pytest.approx(12 / 16)
    assert balanced_accuracy(CONFUSION) == pytest.approx((5 / 6 + 3 / 6 + 4 / 4) / 3)
    # F1 = 2TP / (2TP + FP + FN): class 0 (5, 2, 1), class 1 (3, 1, 3), class 2 (4, 1, 0).
    f1 = [10 / 13, 6 / 10, 8 / 9]
    assert macro_f1(CONFUSION) == pytest.approx(np.mean(f1))
    stacked = np.stack([CONFUSION, np.eye(3)])
    assert accuracy(stacked).tolist() == pytest.approx([0.75, 1.0])


def test_bootstrap_matches_exact_enumeration():
    speakers = ["a", "a", "b", "b", "b", "c"]
    labels = ["x", "y", "y", "x", "y", "x"]
    preds = ["x", "x", "y", "y", "y", "x"]
    out = bootstrap_classification(
        speakers=speakers, labels=labels, predictions=preds, num_resamples=30_000, seed=1
    )
    assert out["accuracy"]["value"] == pytest.approx(4 / 6)
    # Exact: 3^3 = 27 equally likely ordered draws of speakers.
    per_spk = {"a": [(0, 0), (1, 0)], "b": [(1, 1), (0, 1), (1, 1)], "c": [(0, 0)]}
    exact = []
    for draw in itertools.product("abc", repeat=3):
        pairs = [p for s in draw for p in per_spk[s]]
        exact.append(np.mean([t == p for t, p in pairs]))
    exact = np.sort(exact)
    low, high = out["accuracy"]["ci"]
    assert exact[int(np.ceil(0.015 * 27)) - 1] <= low <= exact[int(np.ceil(0.035 * 27)) - 1]
    assert exact[int(np.ceil(0.965 * 27)) - 1] <= high <= exact[int(np.ceil(0.985 * 27)) - 1]
    for name in ("balanced_accuracy", "macro_f1"):
        lo, hi = out[name]["ci"]
        assert 0.0 <= lo <= hi <= 1.0


def test_bad_input():
    with pytest.raises(ValueError, match="differ in length"):
        bootstrap_classification(speakers=["a"], labels=[0, 1], predictions=[0], num_resamples=5)
    with pytest.raises(ValueError, match="no examples"):
        bootstrap_classification(speakers=[], labels=[], predictions=[], num_resamples=5)

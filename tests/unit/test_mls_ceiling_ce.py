"""recipes/MLS/studies/ceiling_ce.py: test CE CIs and FedAvg's share of the gap to the ceiling."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "MLS" / "studies"))
import ceiling_ce  # noqa: E402

from speechbrain_fl.metrics import UtteranceErrors, write_utterance_details  # noqa: E402

SPEAKERS = ("s1", "s1", "s2", "s3")
WORDS = np.array([5, 5, 5, 5])


def _details(edits):
    ids = tuple(f"u{i}" for i in range(len(edits)))
    return UtteranceErrors(ids, SPEAKERS, ("",) * len(edits), np.array(edits), WORDS)


def _run(root, seed, method, *, final, round0=None, ce=None):
    folder = root / f"seed{seed}" / method / "freeze_encoder_False"
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"test": {"WER": _details(final).wer}}))
    write_utterance_details(folder / "test_utterances.csv", _details(final))
    if round0 is not None:
        write_utterance_details(folder / "test_utterances_round0.csv", _details(round0))
    if ce is not None:
        write_utterance_details(folder / ceiling_ce.CE_FILE, _details(ce))
    return folder


def test_ceiling_pools_the_seeds_and_measures_the_closure(tmp_path):
    """Round 0 has 16 edits a seed, FedAvg 10, the ceiling 8: FedAvg closes 6/8 of the gap."""
    for seed in (11, 12):
        _run(tmp_path, seed, "fedavg", final=[3, 2, 3, 2], round0=[4, 4, 4, 4])
        _run(tmp_path, seed, "central", final=[2, 2, 2, 2], round0=[4, 4, 4, 4], ce=[1, 1, 2, 2])
    top = ceiling_ce.ceiling(tmp_path, [11, 12, 13])
    assert top["seeds"] == [11, 12] and top["wers"] == [0.4, 0.4]
    assert top["wer_round0"] == pytest.approx(0.8) and top["wer_fedavg"] == pytest.approx(0.5)
    assert top["wer_pooled"] == pytest.approx(0.4) and top["change"] == pytest.approx(-0.4)
    assert top["closure"] == pytest.approx(0.75)
    assert top["closure_ci"][0] <= 0.75 <= top["closure_ci"][1]
    assert top["ce_pooled"] == pytest.approx(0.3)


def test_no_ceiling_without_both_runs(tmp_path):
    _run(tmp_path, 11, "central", final=[2, 2, 2, 2], round0=[4, 4, 4, 4], ce=[1, 1, 1, 1])
    assert ceiling_ce.ceiling(tmp_path, [11]) is None


def test_ce_rows_and_pairs_need_every_seeds_file(tmp_path):
    done = {
        "flat": [(_run(tmp_path, s, "flat", final=[1, 1, 1, 1], ce=[2, 2, 2, 2]), {})
                 for s in (11, 12)],
        "pfl_uniform": [(_run(tmp_path, s, "pfl_uniform", final=[1, 1, 1, 1],
                              ce=[3, 3, 3, 3] if s == 11 else None), {}) for s in (11, 12)],
    }  # fmt: skip
    rows = ceiling_ce.ce_rows(done)
    assert set(rows) == {"flat"} and rows["flat"]["ce_pooled"] == pytest.approx(0.4)
    (pair,) = ceiling_ce.ce_pairs(done, pairs=(("pfl_uniform", "flat"),))
    assert pair["seeds"] == 1 and pair["difference"] == pytest.approx(0.2)

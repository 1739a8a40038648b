"""recipes/MLS/studies/compare.py end to end on two synthetic runs with a known WER difference."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speechbrain_fl.metrics import UtteranceErrors, write_utterance_details

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "MLS" / "studies" / "compare.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def two_runs(tmp_path):
    rng = np.random.default_rng(0)
    n = 300
    ids = tuple(f"utt{i:04d}" for i in range(n))
    speakers = tuple(f"spk{i % 30:02d}" for i in range(n))
    languages = tuple(("de", "fr", "pl")[i % 3] for i in range(n))
    refs = rng.integers(5, 25, n)
    edits_a = rng.binomial(refs, 0.10)
    edits_b = rng.binomial(refs, 0.25)
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    write_utterance_details(
        run_a / "test_utterances.csv", UtteranceErrors(ids, speakers, languages, edits_a, refs)
    )
    # Run B lists the same utterances in another order: compare.py must align by ID.
    order = rng.permutation(n)
    write_utterance_details(
        run_b / "test_utterances.csv",
        UtteranceErrors(ids, speakers, languages, edits_b, refs).take(order),
    )
    expected = (edits_a.sum() - edits_b.sum()) / refs.sum()
    return run_a, run_b, expected


def test_known_difference_is_reported_significant(two_runs):
    run_a, run_b, expected = two_runs
    proc = _run(run_a, run_b, "--num-resamples", 2000, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["difference"] == pytest.approx(expected)
    assert result["ci_low"] < expected < result["ci_high"] < 0
    assert result["significant"] is True and result["p_value"] < 0.01
    assert (result["num_speakers"], result["num_utterances"]) == (30, 300)

    text = _run(run_a / "test_utterances.csv", run_b, "--num-resamples", 500)
    assert text.returncode == 0, text.stderr
    assert f"WER_A - WER_B = {expected:+.4f}" in text.stdout
    assert "significant: A has the lower WER" in text.stdout


def test_same_run_is_not_significant(two_runs):
    run_a, _, _ = two_runs
    proc = _run(run_a, run_a, "--num-resamples", 200)
    assert proc.returncode == 0, proc.stderr
    assert "not significant" in proc.stdout


def test_bad_input_is_named(two_runs, tmp_path):
    run_a, run_b, _ = two_runs
    lines = (run_b / "test_utterances.csv").read_text().splitlines()
    dropped = lines[5].split(",")[0]
    (tmp_path / "short.csv").write_text("\n".join(lines[:5] + lines[6:]) + "\n")
    proc = _run(run_a, tmp_path / "short.csv")
    assert proc.returncode == 2
    assert "missing from" in proc.stderr and dropped in proc.stderr

    empty = tmp_path / "empty_run"
    empty.mkdir()
    proc = _run(run_a, empty)
    assert proc.returncode == 2 and "without test_utterances.csv" in proc.stderr
    proc = _run(tmp_path / "nowhere", run_b)
    assert proc.returncode == 2 and "no run folder or details file" in proc.stderr


def test_also_pools_seeds_speaker_by_speaker(two_runs, tmp_path):
    """--also adds a second seed's pair; the pooled WERs are the seeds' edits over their words
    and the pooled difference is the mean of the two seeds' differences (same utterances)."""
    run_a, run_b, expected = two_runs
    a2, b2 = tmp_path / "a2", tmp_path / "b2"
    for src, dst in ((run_b, a2), (run_a, b2)):  # seed 2: the systems swapped
        dst.mkdir()
        (dst / "test_utterances.csv").write_text((src / "test_utterances.csv").read_text())
    proc = _run(run_a, run_b, "--also", a2, b2, "--num-resamples", 500, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["difference"] == pytest.approx(0.0, abs=1e-12)
    assert (result["num_speakers"], result["num_utterances"]) == (30, 600)
    assert result["significant"] is False
    bad = _run(run_a, run_b, "--also", a2, tmp_path / "missing")
    assert bad.returncode == 2 and "missing" in bad.stderr

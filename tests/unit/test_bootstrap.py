"""Speaker-level bootstrap: checked against the exact bootstrap distribution of a small case.

With S = 4 speakers there are 4^4 = 256 equally likely ordered resamples; enumerating them gives
the exact distribution that the Monte-Carlo bootstrap approximates. The scipy-based resampling
is also checked against the count-matrix implementation it replaced (same seed, same intervals).
"""

import itertools
import math

import numpy as np
import pytest
from speechbrain.utils.metric_stats import ErrorRateStats

from speechbrain_fl.metrics import (
    UtteranceErrors,
    align_utterances,
    bootstrap_wer,
    paired_bootstrap_wer,
    read_utterance_details,
    resampling,
    speaker_bootstrap,
    utterance_errors_from_stats,
    wer_by_language,
    wer_replicates,
    wer_report,
    write_utterance_details,
)
from speechbrain_fl.metrics.classification import bootstrap_classification

# Four speakers with 1-3 utterances each; within-speaker utterances differ a lot, so an
# utterance-level resampler would produce values outside the speaker-level support.
SPEAKERS = ["s1", "s1", "s2", "s3", "s3", "s3", "s4"]
EDITS_A = np.array([0, 6, 1, 2, 0, 3, 4])
EDITS_B = np.array([1, 5, 3, 2, 2, 3, 2])
REFS = np.array([10, 6, 8, 12, 9, 7, 11])


def _speaker_sums(values):
    names = sorted(set(SPEAKERS))
    return np.array(
        [sum(v for s, v in zip(SPEAKERS, values, strict=True) if s == n) for n in names]
    )


def _exact_distribution(statistic):
    """Values of ``statistic(draw)`` over all 4^4 ordered draws of speaker indices."""
    return np.array([statistic(draw) for draw in itertools.product(range(4), repeat=4)])


def _exact_quantile(values, p):
    """Inverse-CDF quantile of the uniform distribution over ``values``."""
    ordered = np.sort(values)
    return ordered[max(0, math.ceil(p * ordered.size) - 1)]


def _atom_frequencies(samples, atoms):
    """Frequency of each distinct exact atom among ``samples`` (matched with isclose)."""
    distinct = np.unique(np.round(atoms, 12))
    index = np.abs(samples[:, None] - distinct[None, :]).argmin(axis=1)
    assert np.allclose(samples, distinct[index], atol=1e-12), "replicate outside exact support"
    return distinct, np.bincount(index, minlength=distinct.size) / samples.size


def test_wer_bootstrap_converges_to_exact_distribution():
    e, r = _speaker_sums(EDITS_A), _speaker_sums(REFS)
    exact = _exact_distribution(lambda d: e[list(d)].sum() / r[list(d)].sum())
    reps = wer_replicates(
        speakers=SPEAKERS, num_edits=EDITS_A, num_ref_tokens=REFS, num_resamples=40_000, seed=3
    )
    distinct, freq = _atom_frequencies(reps, exact)
    exact_prob = np.array([np.isclose(exact, a, atol=1e-12).mean() for a in distinct])
    assert np.abs(freq - exact_prob).max() < 0.01
    assert reps.mean() == pytest.approx(exact.mean(), abs=2e-3)

    ci = bootstrap_wer(
        speakers=SPEAKERS, num_edits=EDITS_A, num_ref_tokens=REFS, num_resamples=40_000, seed=3
    )
    assert ci.wer == pytest.approx(EDITS_A.sum() / REFS.sum())
    for estimate, p in ((ci.ci_low, 0.025), (ci.ci_high, 0.975)):
        assert _exact_quantile(exact, p - 0.01) <= estimate <= _exact_quantile(exact, p + 0.01)
    assert (ci.num_speakers, ci.num_utterances, ci.num_resamples) == (4, 7, 40_000)


def test_paired_bootstrap_converges_to_exact_distribution():
    ea, eb, r = _speaker_sums(EDITS_A), _speaker_sums(EDITS_B), _speaker_sums(REFS)

    def diff(d):
        d = list(d)
        return ea[d].sum() / r[d].sum() - eb[d].sum() / r[d].sum()

    exact = _exact_distribution(diff)
    reps = wer_replicates(
        speakers=SPEAKERS,
        num_edits=EDITS_A,
        num_edits_b=EDITS_B,
        num_ref_tokens=REFS,
        num_resamples=40_000,
        seed=5,
    )
    distinct, freq = _atom_frequencies(reps, exact)
    exact_prob = np.array([np.isclose(exact, a, atol=1e-12).mean() for a in distinct])
    assert np.abs(freq - exact_prob).max() < 0.01

    res = paired_bootstrap_wer(
        speakers=SPEAKERS,
        num_edits_a=EDITS_A,
        num_edits_b=EDITS_B,
        num_ref_tokens=REFS,
        num_resamples=40_000,
        seed=5,
    )
    assert res.difference == pytest.approx((EDITS_A.sum() - EDITS_B.sum()) / REFS.sum())
    assert res.wer_a - res.wer_b == pytest.approx(res.difference)
    for estimate, p in ((res.ci_low, 0.025), (res.ci_high, 0.975)):
        assert _exact_quantile(exact, p - 0.01) <= estimate <= _exact_quantile(exact, p + 0.01)
    exact_p = min(1.0, 2 * min((exact <= 1e-12).mean(), (exact >= -1e-12).mean()))
    assert res.p_value == pytest.approx(exact_p, abs=0.02)
    assert res.prob_a_better == pytest.approx((exact < -1e-12).mean(), abs=0.02)
    assert res.significant == (res.ci_low > 0 or res.ci_high < 0)


def test_paired_clear_difference_is_significant_and_identical_systems_are_not():
    rng = np.random.default_rng(0)
    speakers = [f"spk{i % 40}" for i in range(400)]
    refs = rng.integers(5, 20, 400)
    good = rng.binomial(refs, 0.10)
    bad = rng.binomial(refs, 0.30)
    res = paired_bootstrap_wer(
        speakers=speakers,
        num_edits_a=good,
        num_edits_b=bad,
        num_ref_tokens=refs,
        num_resamples=2000,
    )
    assert res.significant and res.ci_high < 0 and res.p_value < 0.01
    assert res.prob_a_better == 1.0
    same = paired_bootstrap_wer(
        speakers=speakers,
        num_edits_a=good,
        num_edits_b=good,
        num_ref_tokens=refs,
        num_resamples=500,
    )
    assert (same.difference, same.ci_low, same.ci_high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert not same.significant
    assert same.to_dict()["significant"] is False


def _count_matrix_replicates(totals, statistic, *, num_resamples, seed):
    """The replaced implementation: N @ T with N the (B x S) multinomial speaker counts."""
    s = totals.shape[0]
    draws = np.random.default_rng(seed).integers(0, s, size=(num_resamples, s))
    counts = np.stack([np.bincount(row, minlength=s) for row in draws]).astype(float)
    return statistic((counts @ totals).T)


def test_scipy_resampling_reproduces_the_count_matrix_implementation():
    """Same seed, same speaker draws: the replicates equal those of the count-matrix
    implementation that scipy replaced, and the intervals are the numbers it gave on these
    fixed data (WER, paired difference, classification)."""
    e, r = _speaker_sums(EDITS_A), _speaker_sums(REFS)
    totals = np.stack([e, r], axis=1).astype(float)
    boot = speaker_bootstrap(totals, lambda t: t[0] / t[1], num_resamples=999, seed=4)
    ref = _count_matrix_replicates(totals, lambda t: t[0] / t[1], num_resamples=999, seed=4)
    assert np.array_equal(boot.replicates, ref)
    assert (boot.ci_low, boot.ci_high) == tuple(np.quantile(ref, [0.025, 0.975]))

    kwargs = dict(speakers=SPEAKERS, num_ref_tokens=REFS, num_resamples=10_000, seed=0)
    ci = bootstrap_wer(num_edits=EDITS_A, **kwargs)
    assert (ci.ci_low, ci.ci_high) == pytest.approx((0.16666666666666666, 0.37037037037037035))
    paired = paired_bootstrap_wer(num_edits_a=EDITS_A, num_edits_b=EDITS_B, **kwargs)
    assert (paired.ci_low, paired.ci_high, paired.p_value, paired.prob_a_better) == (
        pytest.approx((-0.15, 0.0975609756097561, 0.744, 0.628))
    )
    rng = np.random.default_rng(1)
    speakers = [f"spk{i % 150}" for i in range(1200)]
    refs = rng.integers(3, 25, 1200)
    edits_a, edits_b = rng.binomial(refs, 0.2), rng.binomial(refs, 0.22)
    ci = bootstrap_wer(
        speakers=speakers,
        num_edits=edits_a,
        num_ref_tokens=refs,
        num_resamples=5000,
        seed=11,
        confidence=0.9,
    )
    assert (ci.ci_low, ci.ci_high) == pytest.approx((0.19433793846156106, 0.20431329070715235))
    paired = paired_bootstrap_wer(
        speakers=speakers,
        num_edits_a=edits_a,
        num_edits_b=edits_b,
        num_ref_tokens=refs,
        num_ref_tokens_b=refs + 1,
        num_resamples=5000,
        seed=12,
    )
    assert (paired.ci_low, paired.ci_high, paired.p_value, paired.prob_a_better) == (
        pytest.approx((-0.008302488798645903, 0.007756990159651525, 0.9152, 0.5424))
    )
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 3, 60)
    predictions = np.where(rng.random(60) < 0.7, labels, rng.integers(0, 3, 60))
    cls = bootstrap_classification(
        speakers=[f"s{i % 12}" for i in range(60)],
        labels=labels,
        predictions=predictions,
        num_resamples=3000,
        seed=4,
    )
    assert {k: v["ci"] for k, v in cls.items()} == {
        "accuracy": pytest.approx([0.7166666666666667, 0.9]),
        "balanced_accuracy": pytest.approx([0.6925771347675372, 0.8937945632798573]),
        "macro_f1": pytest.approx([0.6983481952806666, 0.8951327373882073]),
    }


def test_batches_do_not_change_the_draws(monkeypatch):
    kwargs = dict(speakers=SPEAKERS, num_edits=EDITS_A, num_ref_tokens=REFS, num_resamples=999)
    whole = wer_replicates(**kwargs)
    monkeypatch.setattr(resampling, "_BATCH_ENTRIES", 8)  # forces many small batches
    assert np.array_equal(whole, wer_replicates(**kwargs))


def test_single_speaker_interval_is_the_point():
    ci = bootstrap_wer(speakers=["a", "a"], num_edits=[1, 2], num_ref_tokens=[5, 5])
    assert (ci.wer, ci.ci_low, ci.ci_high) == (0.3, 0.3, 0.3)


def test_seed_determinism():
    kwargs = dict(speakers=SPEAKERS, num_edits=EDITS_A, num_ref_tokens=REFS, num_resamples=500)
    assert bootstrap_wer(**kwargs, seed=7) == bootstrap_wer(**kwargs, seed=7)
    assert not np.array_equal(wer_replicates(**kwargs, seed=7), wer_replicates(**kwargs, seed=8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_edits=EDITS_A[:3]), "num_edits has 3 entries"),
        (dict(num_edits=np.where(EDITS_A == 6, -1, EDITS_A)), r"num_edits\[1\] = -1\.0 is not"),
        (dict(num_ref_tokens=np.where(REFS == 8, np.nan, REFS)), r"num_ref_tokens\[2\] = nan"),
        (dict(num_ref_tokens=np.where(REFS == 11, 0, REFS)), "speaker 's4' has no reference"),
        (dict(confidence=1.0), "confidence must be in"),
        (dict(num_resamples=0), "num_resamples must be >= 1"),
        (dict(num_resamples=10.5), "num_resamples must be an integer"),
        (dict(speakers=[], num_edits=[], num_ref_tokens=[]), "no utterances"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    args = dict(speakers=SPEAKERS, num_edits=EDITS_A, num_ref_tokens=REFS, num_resamples=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        bootstrap_wer(**args)


def test_per_language_and_report():
    langs = ["de", "de", "de", "fr", "fr", "fr", "fr"]
    details = UtteranceErrors(
        tuple(str(i) for i in range(7)), tuple(SPEAKERS), tuple(langs), EDITS_A, REFS
    )
    per_lang = wer_by_language(details, num_resamples=300)
    assert per_lang["de"].wer == pytest.approx(EDITS_A[:3].sum() / REFS[:3].sum())
    assert per_lang["fr"].num_speakers == 2 and per_lang["fr"].num_utterances == 4
    report = wer_report(details, num_resamples=300)
    assert report["WER"] == pytest.approx(details.wer)
    low, high = report["WER_ci95"]
    assert low <= report["WER"] <= high
    assert set(report["per_language"]) == {"de", "fr"}
    assert report["per_language"]["de"]["WER_ci95"] == [
        per_lang["de"].ci_low,
        per_lang["de"].ci_high,
    ]


def test_from_error_rate_stats_matches_speechbrain_wer():
    stats = ErrorRateStats()
    stats.append(
        ids=["u1", "u2"], predict=[["a", "b", "c"], ["d"]], target=[["a", "x"], ["d", "e"]]
    )
    stats.append(ids=["u3"], predict=[["f", "g"]], target=[["f", "g"]])
    speaker_of = {"u1": "s1", "u2": "s2", "u3": "s1"}
    details = utterance_errors_from_stats(
        stats, speaker_of=speaker_of, language_of={"u1": "it", "u2": "it", "u3": "pl"}
    )
    assert details.ids == ("u1", "u2", "u3")
    assert details.speakers == ("s1", "s2", "s1")
    assert details.num_edits.tolist() == [2, 1, 0]
    assert details.num_ref_tokens.tolist() == [2, 2, 2]
    assert details.wer == pytest.approx(stats.summarize("WER") / 100)
    with pytest.raises(ValueError, match="'u2' has no speaker"):
        utterance_errors_from_stats(stats, speaker_of={"u1": "s1", "u3": "s1"})


def test_details_csv_round_trip_and_errors(tmp_path):
    details = UtteranceErrors(
        ("b", "a"), ("s2", "s1"), ("nl", ""), np.array([1, 2.5]), np.array([4, 5])
    )
    path = write_utterance_details(tmp_path / "run" / "test_utterances.csv", details)
    assert path.read_text().splitlines()[0] == "ID,spk_id,language,num_edits,num_ref_tokens"
    back = read_utterance_details(path)
    assert back.ids == details.ids and back.languages == details.languages
    assert np.array_equal(back.num_edits, details.num_edits)
    write_utterance_details(tmp_path / "rows.csv", details.rows())
    assert read_utterance_details(tmp_path / "rows.csv").wer == details.wer

    with pytest.raises(FileNotFoundError, match="nothere.csv"):
        read_utterance_details(tmp_path / "nothere.csv")
    (tmp_path / "bad.csv").write_text("ID,spk_id,num_edits\nx,s,1\n")
    with pytest.raises(ValueError, match=r"bad\.csv.*num_ref_tokens"):
        read_utterance_details(tmp_path / "bad.csv")
    (tmp_path / "val.csv").write_text("ID,spk_id,num_edits,num_ref_tokens\nx,s,one,3\n")
    with pytest.raises(ValueError, match=r"val\.csv.*'x'"):
        read_utterance_details(tmp_path / "val.csv")
    (tmp_path / "dup.csv").write_text("ID,spk_id,num_edits,num_ref_tokens\nx,s,1,3\nx,s,1,3\n")
    with pytest.raises(ValueError, match="'x' appears more than once"):
        read_utterance_details(tmp_path / "dup.csv")


def test_align_names_missing_ids_and_speaker_mismatch():
    a = UtteranceErrors(
        ("1", "2", "3"), ("s", "s", "t"), ("", "", ""), np.array([1, 0, 2]), np.array([3, 3, 3])
    )
    a2, b2 = align_utterances(a, a.take([2, 0, 1]))
    assert b2.ids == a2.ids == ("1", "2", "3")
    with pytest.raises(ValueError, match="1 utterance.*missing from B: 3"):
        align_utterances(a, a.take([0, 1]))
    other = UtteranceErrors(
        ("1", "2", "3"), ("s", "x", "t"), ("", "", ""), np.array([1, 0, 2]), np.array([3, 3, 3])
    )
    with pytest.raises(ValueError, match="'2' has speaker 's' in A and 'x' in B"):
        align_utterances(a, other)

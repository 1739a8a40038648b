"""Poisson cohort sampling: binomial statistics, keyed draws, OS seeding."""

import numpy as np
import pytest

from speechbrain_fl.fl.dp.sampling import PoissonSampler


def test_cohort_size_is_binomial():
    k, q, draws = 50, 0.2, 3000
    sampler = PoissonSampler(q, seed=1)
    sizes = np.array([len(sampler.sample(range(k))) for _ in range(draws)])
    # mean qK = 10, variance Kq(1-q) = 8; 5-sigma bands of the estimators
    assert abs(sizes.mean() - q * k) < 5 * np.sqrt(k * q * (1 - q) / draws)
    assert abs(sizes.var() - k * q * (1 - q)) < 1.0
    assert sizes.min() >= 0 and sizes.max() <= k
    assert sampler.expected_cohort_size(k) == pytest.approx(10.0)


def test_each_node_included_with_probability_q():
    sampler = PoissonSampler(0.3, seed=2)
    counts = np.zeros(10)
    for _ in range(4000):
        counts[sampler.sample(range(10))] += 1
    assert np.all(np.abs(counts / 4000 - 0.3) < 0.03)


def test_draw_keys_reproduce_cohorts_without_saved_state():
    # a fixed (public or test-only) seed: the cohort of a draw key is the same in any process,
    # so a resumed run needs no sampler state on disk
    a, b = PoissonSampler(0.5, seed=3), PoissonSampler(0.5, seed=3)
    a.sample(range(20), draw=(1, 0))
    assert [a.sample(range(20), draw=(r, 0)) for r in range(2, 7)] == [
        b.sample(range(20), draw=(r, 0)) for r in range(2, 7)
    ]
    assert a.sample(range(20), draw=(2, 0)) != a.sample(range(20), draw=(2, 1))  # a retry
    assert not hasattr(a, "state_dict")
    # OS-seeded samplers are independent of each other (P(equal) = 2^-100 here)
    assert PoissonSampler(0.5).sample(range(100), draw=(1, 0)) != PoissonSampler(0.5).sample(
        range(100), draw=(1, 0)
    )
    assert PoissonSampler(0.5).seeded_from_os and not a.seeded_from_os


def test_cohort_follows_the_order_key_not_the_node_id():
    # relabelled nodes, same partitions: the same partitions are drawn
    c, d = PoissonSampler(0.5, seed=4), PoissonSampler(0.5, seed=4)
    ids_c, ids_d = [11, 7, 3], [100, 5, 42]  # partition 0, 1, 2 in each run
    got_c = c.sample(ids_c, order={11: 0, 7: 1, 3: 2}, draw=(1, 0))
    got_d = d.sample(ids_d, order={100: 0, 5: 1, 42: 2}, draw=(1, 0))
    to_part_c, to_part_d = {11: 0, 7: 1, 3: 2}, {100: 0, 5: 1, 42: 2}
    assert [to_part_c[n] for n in got_c] == [to_part_d[n] for n in got_d]


def test_bad_rate_rejected():
    with pytest.raises(ValueError, match="sampling_rate"):
        PoissonSampler(0.0)

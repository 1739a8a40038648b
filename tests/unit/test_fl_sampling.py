"""Poisson cohort sampling: binomial statistics, determinism, resumable state."""

import numpy as np
import pytest

from speechbrain_fl.fl.sampling import PoissonSampler


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


def test_state_resumes_same_cohorts_and_order_key():
    a = PoissonSampler(0.5, seed=3)
    a.sample(range(20))
    b = PoissonSampler(0.5, seed=99)
    b.load_state_dict(a.state_dict())
    assert [a.sample(range(20)) for _ in range(5)] == [b.sample(range(20)) for _ in range(5)]
    # the cohort follows the order key, not the node id: relabelled nodes, same partitions
    c, d = PoissonSampler(0.5, seed=4), PoissonSampler(0.5, seed=4)
    ids_c, ids_d = [11, 7, 3], [100, 5, 42]  # partition 0, 1, 2 in each run
    got_c = c.sample(ids_c, order={11: 0, 7: 1, 3: 2})
    got_d = d.sample(ids_d, order={100: 0, 5: 1, 42: 2})
    to_part_c, to_part_d = {11: 0, 7: 1, 3: 2}, {100: 0, 5: 1, 42: 2}
    assert [to_part_c[n] for n in got_c] == [to_part_d[n] for n in got_d]


def test_bad_rate_rejected():
    with pytest.raises(ValueError, match="sampling_rate"):
        PoissonSampler(0.0)

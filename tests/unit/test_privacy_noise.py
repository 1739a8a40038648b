"""Gaussian mechanism: calibration, seeding, no secret in the state, the noisy norm signal."""

import logging
import math

import pytest
import torch

from speechbrain_fl.privacy import GaussianNoise, Group, Layout, noise_std, noisy_norm_signal


def test_empirical_std_within_two_percent():
    sigma, clip, n = 0.7, 2.0, 25
    mech = GaussianNoise(noise_multiplier=sigma, clip=clip)  # OS-seeded: no fixed seed
    agg = {"a": torch.zeros(600_000), "b": torch.zeros(500, 1000)}  # 1.1e6 draws
    out = mech.add(agg, expected_cohort_size=n)
    draws = torch.cat([out["a"], out["b"].flatten()]).double()
    assert draws.numel() >= 1_000_000
    expected = sigma * clip / n
    assert float(draws.std()) == pytest.approx(expected, rel=0.02)
    assert abs(float(draws.mean())) < 5 * expected / math.sqrt(draws.numel())
    assert torch.count_nonzero(agg["a"]) == 0, "aggregate must not be modified"


def test_noise_cohort_size_sets_the_std_on_the_mean_to_sigma_c_over_m():
    """A simulated deployment of M clients: std sigma C / M on the mean of the n updates
    (sigma C n / M on their sum), whatever n; the state records M and a resume may not change it."""
    sigma, clip, n, m = 0.7, 2.0, 4, 1000
    mech = GaussianNoise(noise_multiplier=sigma, clip=clip, noise_cohort_size=m)
    out = mech.add({"w": torch.zeros(1_000_000)}, expected_cohort_size=n)["w"].double()
    assert mech.std(n) == sigma * clip / m
    assert float(out.std()) == pytest.approx(sigma * clip / m, rel=0.02)
    assert float((out * n).std()) == pytest.approx(sigma * clip * n / m, rel=0.02)  # on the sum
    assert mech.state_dict() == {"noise_multiplier": sigma, "clip": clip, "noise_cohort_size": m}
    plain = GaussianNoise(noise_multiplier=sigma, clip=clip)
    assert "noise_cohort_size" not in plain.state_dict() and plain.std(n) == sigma * clip / n
    with pytest.raises(ValueError, match="noise_cohort_size=1000 but this mechanism uses None"):
        plain.load_state_dict(mech.state_dict())
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="noise_cohort_size must be an integer >= 1"):
            GaussianNoise(noise_multiplier=sigma, clip=clip, noise_cohort_size=bad)


def test_noise_std_formula_and_errors():
    assert noise_std(noise_multiplier=0.1, clip=1.0, expected_cohort_size=94) == 0.1 / 94
    with pytest.raises(ValueError, match="noise_multiplier"):
        noise_std(noise_multiplier=-0.1, clip=1.0, expected_cohort_size=10)
    with pytest.raises(ValueError, match="clip"):
        noise_std(noise_multiplier=0.1, clip=0.0, expected_cohort_size=10)
    with pytest.raises(ValueError, match="cohort"):
        noise_std(noise_multiplier=0.1, clip=1.0, expected_cohort_size=0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        GaussianNoise(noise_multiplier=-1.0, clip=1.0)


def test_fixed_seed_warns_and_is_reproducible(caplog):
    with caplog.at_level(logging.WARNING):
        a = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=123)
    assert any("testing only" in r.getMessage() for r in caplog.records)
    b = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=123)
    x = {"w": torch.zeros(10)}
    assert torch.equal(a.add(x, expected_cohort_size=1)["w"], b.add(x, expected_cohort_size=1)["w"])


def test_os_seeded_generators_differ_and_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING):
        a = GaussianNoise(noise_multiplier=1.0, clip=1.0)
        b = GaussianNoise(noise_multiplier=1.0, clip=1.0)
    assert not caplog.records
    x = {"w": torch.zeros(10)}
    assert not torch.equal(
        a.add(x, expected_cohort_size=1)["w"], b.add(x, expected_cohort_size=1)["w"]
    )


def test_state_dict_holds_no_seed_and_keyed_draws_reproduce():
    a = GaussianNoise(noise_multiplier=1.0, clip=1.0)
    x = {"w": torch.zeros(8)}
    first = a.add(x, expected_cohort_size=1, draw=1)["w"]
    state = a.state_dict()
    assert state == {"noise_multiplier": 1.0, "clip": 1.0}  # nothing to regenerate the noise
    b = GaussianNoise(noise_multiplier=1.0, clip=1.0)
    b.load_state_dict(state)
    assert not torch.equal(b.add(x, expected_cohort_size=1, draw=1)["w"], first)  # fresh seed
    # a changed noise scale is refused, not silently adopted
    with pytest.raises(ValueError, match="clip"):
        GaussianNoise(noise_multiplier=1.0, clip=4.0).load_state_dict(state)
    # test-only fixed seed: draw k is the same in any process (a resumed test run)
    c, d = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=5), None
    c.add(x, expected_cohort_size=1, draw=1)
    d = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=5)
    assert torch.equal(
        c.add(x, expected_cohort_size=1, draw=2)["w"], d.add(x, expected_cohort_size=1, draw=2)["w"]
    )
    assert not torch.equal(
        d.add(x, expected_cohort_size=1, draw=3)["w"], d.add(x, expected_cohort_size=1, draw=4)["w"]
    )


def test_noisy_norm_signal_is_unbiased():
    # true group norms 3 and 0.5; std 0.05 on p = 2000 / 500 entries
    lay = Layout([Group("a", "llm", 2000), Group("b", "encoder", 500, ("b1", "b2"))])
    gen = torch.Generator().manual_seed(0)
    sig = torch.randn(2000, generator=gen, dtype=torch.float64)
    sig_a = sig / sig.norm() * 3.0
    b = torch.randn(500, generator=gen, dtype=torch.float64)
    b = b / b.norm() * 0.5
    std = 0.05
    est_sq = {"a": [], "b": []}
    for _ in range(400):
        agg = {
            "a": sig_a + std * torch.randn(2000, generator=gen, dtype=torch.float64),
            "b1": b[:200] + std * torch.randn(200, generator=gen, dtype=torch.float64),
            "b2": b[200:] + std * torch.randn(300, generator=gen, dtype=torch.float64),
        }
        raw = {
            "a": float(agg["a"].norm() ** 2) - 2000 * std**2,
            "b": float(agg["b1"].norm() ** 2 + agg["b2"].norm() ** 2) - 500 * std**2,
        }
        out = noisy_norm_signal(agg, lay, std=std)
        for k in raw:
            assert out[k] == pytest.approx(math.sqrt(max(0.0, raw[k])), rel=1e-9)
            est_sq[k].append(raw[k])
    # the squared-norm estimate (before the clamp) is unbiased
    assert sum(est_sq["a"]) / 400 == pytest.approx(9.0, rel=0.01)
    assert sum(est_sq["b"]) / 400 == pytest.approx(0.25, rel=0.05)
    naive = float(agg["b1"].norm() ** 2 + agg["b2"].norm() ** 2)
    assert naive > 0.25 + 0.5 * 500 * std**2  # without the correction the noise dominates


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_noise_is_a_float64_gaussian_rounded_once(dtype):
    # CPU float32/float64: NumPy's PCG64 + ziggurat in float64 (noise.py "Decisions")
    sigma, clip, n = 1.0, 0.5, 4
    mech = GaussianNoise(noise_multiplier=sigma, clip=clip)
    agg = {"w": torch.full((1_000_000,), 3.0, dtype=dtype)}
    out = mech.add(agg, expected_cohort_size=n, draw=1)
    assert out["w"].dtype == dtype and out["w"].shape == agg["w"].shape
    z = (out["w"].double() - 3.0) / (sigma * clip / n)
    assert float(z.std()) == pytest.approx(1.0, rel=0.01)
    assert abs(float(z.mean())) < 5 / math.sqrt(z.numel())
    kurtosis = float((z - z.mean()).pow(4).mean() / z.var() ** 2)
    assert kurtosis == pytest.approx(3.0, abs=0.05)  # SE ~0.005 at 1e6 draws
    assert torch.equal(agg["w"], torch.full((1_000_000,), 3.0, dtype=dtype))  # not modified


def test_float32_noise_is_the_float64_draw_rounded():
    x32, x64 = {"w": torch.zeros(1000)}, {"w": torch.zeros(1000, dtype=torch.float64)}
    a = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=9).add(x32, expected_cohort_size=3)
    b = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=9).add(x64, expected_cohort_size=3)
    assert torch.equal(a["w"], b["w"].to(torch.float32))


def test_other_dtypes_draw_with_torch_at_the_same_scale():
    mech = GaussianNoise(noise_multiplier=2.0, clip=1.0)
    out = mech.add({"w": torch.zeros(400_000, dtype=torch.bfloat16)}, expected_cohort_size=8)
    assert out["w"].dtype == torch.bfloat16
    assert float(out["w"].double().std()) == pytest.approx(0.25, rel=0.03)


def _aggregate(dtype, order=("w", "b", "s")):
    tensors = {
        "w": torch.randn(64, 33, dtype=torch.float64),
        "b": torch.randn(7, dtype=torch.float64),
        "s": torch.tensor(0.5, dtype=torch.float64),  # a 0-d parameter
    }
    return {k: tensors[k].to(dtype) for k in order}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prepared_noise_is_bit_identical_and_leaves_the_same_generator(dtype):
    torch.manual_seed(0)
    aggregate = _aggregate(dtype)
    # prepared in another order than the aggregate's: the draws follow the aggregate's order
    sizes = [7, 1, 64 * 33]
    plain, prepared = (GaussianNoise(noise_multiplier=0.7, clip=0.3, seed=4) for _ in range(2))
    prepared.prepare(sizes, draw=3)
    assert prepared._prepared is not None
    a = plain.add(aggregate, expected_cohort_size=5.0, draw=3)
    b = prepared.add(aggregate, expected_cohort_size=5.0, draw=3)
    assert prepared._prepared is None and list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == dtype and a[name].shape == b[name].shape
        assert torch.equal(a[name], b[name]), name
    # the draw's generator continues where the unprepared draws left it
    again_a = plain.add(aggregate, expected_cohort_size=5.0, draw=3)
    again_b = prepared.add(aggregate, expected_cohort_size=5.0, draw=3)
    assert all(torch.equal(again_a[k], again_b[k]) for k in again_a)
    assert not any(torch.equal(a[k], again_a[k]) for k in ("w", "b"))  # a new stretch


def test_a_preparation_that_does_not_fit_is_dropped_and_changes_nothing():
    aggregate = _aggregate(torch.float64)
    cases = [
        ([64 * 33, 7], 3),  # one tensor fewer than the aggregate has
        ([64 * 33, 7, 1], 2),  # another draw
        ([64 * 33, 7, 1], 3),  # the right one, but the aggregate is half bfloat16 below
    ]
    for sizes, draw in cases:
        mixed = dict(aggregate)
        if (sizes, draw) == cases[2]:
            mixed["b"] = mixed["b"].to(torch.bfloat16)
        plain, prepared = (GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=9) for _ in range(2))
        prepared.prepare(sizes, draw=draw)
        a = plain.add(mixed, expected_cohort_size=2.0, draw=3)
        b = prepared.add(mixed, expected_cohort_size=2.0, draw=3)
        assert all(torch.equal(a[k], b[k]) for k in a), (sizes, draw)
        # the next draw too: nothing of the dropped preparation reached a generator
        a = plain.add(mixed, expected_cohort_size=2.0, draw=4)
        b = prepared.add(mixed, expected_cohort_size=2.0, draw=4)
        assert all(torch.equal(a[k], b[k]) for k in a), (sizes, draw)


def test_a_draw_already_used_is_not_prepared_and_the_stream_is_unchanged():
    aggregate = _aggregate(torch.float64)
    plain, prepared = (GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=2) for _ in range(2))
    plain.add(aggregate, expected_cohort_size=3.0, draw=5)
    prepared.add(aggregate, expected_cohort_size=3.0, draw=5)
    prepared.prepare([64 * 33, 7, 1], draw=5)  # its generator exists: continuing it is add's job
    assert prepared._prepared is None
    a = plain.add(aggregate, expected_cohort_size=3.0, draw=5)
    b = prepared.add(aggregate, expected_cohort_size=3.0, draw=5)
    assert all(torch.equal(a[k], b[k]) for k in a)

"""Adaptive clipping (speechbrain_fl/privacy/adaptive_clipping.py, speechbrain_fl/fl/dp/adaptive.py).

Checked: Theorem 1 against Flower's own ``compute_adaptive_noise_params`` (one pool) and the
identity z^-2 = sigma_Delta^-2 + z_b^-2 (P pools); the joint sensitivity of update and bits over
adversarial updates (hypothesis) through the real clip and bits code; the noise scale of the
count and of the update against the formulas (empirical std); the epsilon of the pair against an
independent accountant (dp-accounting's RDP of the composed event) and ours at z; the geometric
update's direction and fixed point; SecAgg+'s decoding of the bit sums with Flower's quantiser.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speechbrain_fl.fl.dp.adaptive import method_pools, round_budgets
from speechbrain_fl.privacy import Group, Layout, clip_update, compute_epsilon
from speechbrain_fl.privacy.adaptive_clipping import (
    QuantileClipState,
    check_bits,
    clip_bits,
    count_noise_multiplier,
    update_noise_multiplier,
)

LAYOUT = Layout(
    [
        Group("enc.w", "encoder", 12),
        Group("enc.b", "encoder", 3),
        Group("con.w", "connector", 6),
        Group("llm.a", "llm", 10),
    ]
)
POOLS = {"encoder": ["encoder"], "llm": ["llm", "connector"]}


@settings(max_examples=60, deadline=None)
@given(
    z=st.floats(0.05, 5.0),
    ratio=st.floats(0.51, 50.0),
)
def test_theorem_1_one_pool_equals_flowers(z, ratio):
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    stddev = z * ratio  # z_b = 2 sigma_b > z
    flower_stddev, flower_sigma = compute_adaptive_noise_params(z, 100, stddev)
    assert flower_stddev == stddev
    assert update_noise_multiplier(z, count_stddev=stddev) == pytest.approx(flower_sigma, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(z=st.floats(0.05, 5.0), stddev=st.floats(0.1, 500.0), pools=st.integers(1, 6))
def test_theorem_1_pair_spends_exactly_z(z, stddev, pools):
    z_b = count_noise_multiplier(stddev, num_pools=pools)
    assert z_b == pytest.approx(2 * stddev / math.sqrt(pools))
    if z_b <= z:
        with pytest.raises(ValueError, match="clip_count_stddev"):
            update_noise_multiplier(z, count_stddev=stddev, num_pools=pools)
        return
    sigma = update_noise_multiplier(z, count_stddev=stddev, num_pools=pools)
    assert sigma >= z
    assert sigma**-2 + z_b**-2 == pytest.approx(z**-2, rel=1e-9)


def test_too_small_count_noise_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"clip_count_stddev=0\.5 is too small.*> 0\.7071"):
        update_noise_multiplier(1.0, count_stddev=0.5, num_pools=2)


norms = st.floats(0.0, 1e6, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(
    scales=st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=4, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    clip_e=st.floats(1e-3, 10.0),
    clip_l=st.floats(1e-3, 10.0),
    z=st.floats(0.1, 3.0),
)
def test_joint_sensitivity_of_update_and_bits_over_adversarial_updates(
    scales, seed, clip_e, clip_l, z
):
    """One client's (clipped update, centred bits), each scaled by its noise std, has L2 norm
    at most 1 / z: the pair is a Gaussian mechanism of noise multiplier z (Theorem 1, P = 2)."""
    gen = torch.Generator().manual_seed(seed)
    update = {
        g.name: s * torch.randn(g.numel, generator=gen, dtype=torch.float64)
        for g, s in zip(LAYOUT, scales, strict=True)
    }
    state = QuantileClipState(
        {"encoder": clip_e, "llm": clip_l}, quantile=0.5, learning_rate=0.2, count_stddev=1.0
    )
    budgets = round_budgets(state, LAYOUT, method="alpha_split", pools=POOLS)
    clipped, stats = clip_update(update, budgets, layout=LAYOUT)
    pools = {p: {"components": POOLS[p], "clip": state.clips[p]} for p in state.pools}
    bits = clip_bits(stats.component_norms, pools)
    centred = np.asarray(bits) - 0.5
    assert np.linalg.norm(centred) == pytest.approx(math.sqrt(2) / 2)  # sqrt(P) / 2, every case
    c_total = state.total_clip
    norm = math.sqrt(sum(float(v.norm()) ** 2 for v in clipped.values()))
    assert norm <= c_total * (1 + 1e-9)
    stddev = z  # sigma_b with z_b = 2 z / sqrt(2) = sqrt(2) z > z
    sigma = update_noise_multiplier(z, count_stddev=stddev, num_pools=2)
    scaled = (norm / (sigma * c_total)) ** 2 + float(centred @ centred) / stddev**2
    assert math.sqrt(scaled) <= (1.0 / z) * (1 + 1e-9)
    # each pool's bit says whether that pool's pre-clip norm is within its clip
    for bit, pool in zip(bits, state.pools, strict=True):
        pool_norm = math.sqrt(sum(stats.component_norms.get(c, 0.0) ** 2 for c in POOLS[pool]))
        assert bit == float(pool_norm <= state.clips[pool])


def test_count_noise_scale_matches_sigma_b_over_n():
    n, stddev = 40.0, 3.0
    state = QuantileClipState({"all": 1.0}, quantile=0.5, learning_rate=1e-12,
                              count_stddev=stddev, seed=1)  # fmt: skip
    draws = [
        state.noisy_fractions({"all": 25.0}, expected_cohort_size=n, num_counted=40)["all"]
        for _ in range(20000)
    ]
    assert np.mean(draws) == pytest.approx(25 / 40, abs=4 * stddev / n / math.sqrt(20000))
    assert np.std(draws) == pytest.approx(stddev / n, rel=0.03)
    # a simulated deployment's M sets the noise on the fraction, n the mean of the bits
    sim = [
        state.noisy_fractions(
            {"all": 2.0}, expected_cohort_size=4.0, num_counted=4, noise_cohort_size=400
        )["all"]
        for _ in range(20000)
    ]
    assert np.std(sim) == pytest.approx(stddev / 400, rel=0.03)
    assert np.mean(sim) == pytest.approx(0.5, abs=1e-3)


def test_update_noise_scale_is_sigma_delta_times_the_round_clip():
    from speechbrain_fl.fl.serverapp.strategy import DPFedAvg
    from speechbrain_fl.fl.settings.config import FLConfig

    cfg = FLConfig(output_folder="o", sampling_rate=0.5, noise_multiplier=0.8, clip=0.6,
                   method="alpha_split", alpha=0.25, population_size=40, clip_quantile=0.5,
                   noise_seed=3, sampler_seed=4)  # fmt: skip
    strategy = DPFedAvg(config=cfg, layout=LAYOUT)
    n = strategy.expected_cohort_size()
    sigma = update_noise_multiplier(0.8, count_stddev=n / 20, num_pools=2)
    assert strategy.update_noise_multiplier == pytest.approx(sigma)
    assert strategy.accountant.noise_multiplier == 0.8  # the pair's z
    assert strategy.adaptive.clips == pytest.approx({"encoder": 0.3, "llm": 0.6 * math.sqrt(0.75)})
    strategy.adaptive.clips = {"encoder": 0.2, "llm": 1.5}  # as after some rounds
    strategy.noise.set_clip(strategy.adaptive.total_clip)
    total = math.sqrt(0.2**2 + 1.5**2)
    assert strategy.noise.std(n) == pytest.approx(sigma * total / n)
    zeros = {"w": torch.zeros(200_000, dtype=torch.float64)}
    noisy = strategy.noise.add(zeros, expected_cohort_size=n, draw=1)["w"]
    assert float(noisy.std()) == pytest.approx(sigma * total / n, rel=0.01)
    budgets = strategy.budgets()
    enc = math.sqrt(budgets["enc.w"] ** 2 + budgets["enc.b"] ** 2)
    assert enc == pytest.approx(0.2)
    assert math.sqrt(sum(b * b for b in budgets.values())) == pytest.approx(total)


@pytest.mark.parametrize("pools", [1, 2])
def test_epsilon_of_the_pair_equals_the_accountant_at_z(pools):
    """dp-accounting composes the two Gaussians of one Poisson-sampled round itself; ours
    accounts one Gaussian at z: the same epsilon (RDP), and the PLD of the run's accountant."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    q, z, rounds, delta, stddev = 0.05, 0.9, 200, 1e-5, 2.0
    sigma = update_noise_multiplier(z, count_stddev=stddev, num_pools=pools)
    z_b = count_noise_multiplier(stddev, num_pools=pools)
    pair = dp_event.PoissonSampledDpEvent(
        q,
        dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(sigma), dp_event.GaussianDpEvent(z_b)]),
    )
    rdp = RdpAccountant()
    rdp.compose(dp_event.SelfComposedDpEvent(pair, rounds))
    independent = rdp.get_epsilon(delta)
    ours = compute_epsilon(sampling_rate=q, noise_multiplier=z, rounds=rounds, delta=delta,
                           accountant="rdp")  # fmt: skip
    assert ours == pytest.approx(independent, rel=0.02)
    # the update alone at sigma_Delta would claim less: the count is not free
    alone = compute_epsilon(sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=delta,
                            accountant="rdp")  # fmt: skip
    assert alone < ours


def test_geometric_update_moves_towards_the_quantile():
    rng = np.random.default_rng(0)
    population = rng.lognormal(mean=0.0, sigma=0.5, size=20000)
    for gamma in (0.3, 0.5, 0.8):
        state = QuantileClipState({"all": 10.0}, quantile=gamma, learning_rate=0.2,
                                  count_stddev=1.0, seed=2)  # fmt: skip
        clips = []
        for _ in range(300):
            cohort = rng.choice(population, size=100)
            state.step({"all": float(np.sum(cohort <= state.clips["all"]))},
                       expected_cohort_size=100, num_counted=100)  # fmt: skip
            clips.append(state.clips["all"])
        reached = float(np.mean(population <= np.median(clips[-100:])))
        assert reached == pytest.approx(gamma, abs=0.05)


def test_state_round_trip_and_changed_settings_refused():
    state = QuantileClipState({"encoder": 0.3, "llm": 0.9}, quantile=0.5, learning_rate=0.2,
                              count_stddev=2.0, seed=0)  # fmt: skip
    state.step({"encoder": 3.0, "llm": 1.0}, expected_cohort_size=4)
    saved = state.state_dict()
    again = QuantileClipState({"encoder": 0.3, "llm": 0.9}, quantile=0.5, learning_rate=0.2,
                              count_stddev=2.0)  # fmt: skip
    again.load_state_dict(saved)
    assert again.clips == state.clips
    assert "history" not in saved  # the state does not grow with the rounds
    other = QuantileClipState({"encoder": 0.3, "llm": 0.9}, quantile=0.6, learning_rate=0.2,
                              count_stddev=2.0)  # fmt: skip
    with pytest.raises(ValueError, match="quantile=0.5"):
        other.load_state_dict(saved)


def test_bits_are_checked():
    assert check_bits([1.0, 0.0], 2) == [1.0, 0.0]
    for bad in ([0.5, 1.0], [1.0], "1", None, [2.0, 0.0]):
        with pytest.raises(ValueError):
            check_bits(bad, 2)


def test_pools_of_the_methods():
    assert method_pools("flat", LAYOUT) == {"all": ["encoder", "connector", "llm"]}
    assert method_pools("alpha_split", LAYOUT) == POOLS
    with pytest.raises(ValueError, match="supports methods"):
        method_pools("pfl_dim", LAYOUT)
    no_encoder = Layout([Group("l", "llm", 3)])
    with pytest.raises(ValueError, match="no trainable group"):
        method_pools("alpha_split", no_encoder)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=2),
                  min_size=2, max_size=60),
    box=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_secure_sum_of_bits_decodes_the_exact_count(bits, box, seed):
    """Flower's SecAgg+ quantiser (stochastic rounding into [0, T]) on each client's bit vector,
    the integer sum, the workflow's dequantisation of the sum: the decoded count is exact."""
    from flwr.common.secure_aggregation.quantization import quantize

    from speechbrain_fl.fl.secagg.train_stage import bit_sums, bit_vector
    from speechbrain_fl.privacy.secure_encoding import quantization_range

    np.random.seed(seed % 2**32)
    m = len(bits)
    target = quantization_range(m)
    total = sum(quantize([bit_vector(b, scale=box)], box, target)[0].astype(np.int64) for b in bits)
    decoded_sum = total * (2 * box / target) - m * box  # sum of the m dequantised vectors
    counts = bit_sums(decoded_sum / m, survivors=m, scale=box)
    assert counts == [float(sum(b[i] for b in bits)) for i in range(2)]


def test_disclosure_says_the_count_is_inside_epsilon():
    from speechbrain_fl.fl.dp.disclosure import privacy_disclosure
    from speechbrain_fl.fl.settings.config import FLConfig

    cfg = FLConfig(output_folder="o", noise_multiplier=1.0, clip=1.0, clip_quantile=0.5)
    assert "covered by epsilon" in privacy_disclosure(cfg)["adaptive_clipping_note"]
    fixed = FLConfig(output_folder="o", noise_multiplier=1.0, clip=1.0)
    assert "adaptive_clipping_note" not in privacy_disclosure(fixed)


def test_default_count_noise_is_a_twentieth_of_the_noise_cohort():
    from speechbrain_fl.fl.dp.adaptive import adaptive_state
    from speechbrain_fl.fl.settings.config import FLConfig

    real = FLConfig(output_folder="o", noise_multiplier=1.0, clip=0.4, clip_quantile=0.5)
    state, sigma, pools = adaptive_state(real, LAYOUT, expected_cohort_size=40.0)
    assert state.count_stddev == 2.0 and pools == {"all": ["encoder", "connector", "llm"]}
    assert sigma == pytest.approx(update_noise_multiplier(1.0, count_stddev=2.0))
    simulated = FLConfig(output_folder="o", noise_multiplier=1.0, clip=0.4, clip_quantile=0.5,
                         noise_cohort_size=1000, accounting_population=100000)  # fmt: skip
    state, _, _ = adaptive_state(simulated, LAYOUT, expected_cohort_size=4.0)
    assert state.count_stddev == 50.0  # M / 20, as the update's noise is M's
    with pytest.raises(ValueError, match="clip_count_stddev=0.1 is too small"):
        adaptive_state(FLConfig(output_folder="o", noise_multiplier=1.0, clip=0.4,
                                clip_quantile=0.5, clip_count_stddev=0.1),
                       LAYOUT, expected_cohort_size=40.0)  # fmt: skip

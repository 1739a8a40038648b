"""AW-DP (weighted DP-SGD): weights, the sensitivity bound, the noise scale, OS randomness."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer

from speechbrain_fl.privacy.weighted_dpsgd import (
    BatchAdaptiveDPOptimizer,
    DPSGDPrivacyEngine,
    WeightedDPOptimizer,
    batch_adaptive_factors,
    batch_adaptive_sensitivity,
    class_weights_from_counts,
    os_seeded_generator,
)


def test_class_weights_formula_and_range():
    w = class_weights_from_counts([700, 250, 50], gamma=0.5)
    assert torch.allclose(w, torch.tensor([(50 / 700) ** 0.5, (50 / 250) ** 0.5, 1.0]))
    assert class_weights_from_counts([3, 1, 2], gamma=0.0).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"class index\(es\) \[1\]"):
        class_weights_from_counts([5, 0, 2])
    with pytest.raises(ValueError, match="gamma"):
        class_weights_from_counts([1, 2], gamma=-1)


def _summed(params_data, x, y, *, weights, clip, labels_weighted=True):
    """Noise-free sum of (weighted) clipped per-sample gradients of a linear model."""
    model = torch.nn.Linear(x.shape[1], 3)
    with torch.no_grad():
        model.weight.copy_(params_data[0])
        model.bias.copy_(params_data[1])
    gsm = GradSampleModule(model, loss_reduction="sum")
    kwargs = dict(
        noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=1, loss_reduction="sum"
    )
    if weights is None:
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), **kwargs)
    else:
        opt = WeightedDPOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=0.0), class_weights=weights, **kwargs
        )
        opt.set_labels(y)
    torch.nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    opt.step()
    return torch.cat([p.grad.flatten() for p in gsm.parameters()])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scale=st.floats(0.01, 100.0),
    clip=st.floats(0.05, 5.0),
    gamma=st.floats(0.0, 2.0),
)
def test_sensitivity_bound_add_remove_one_record(seed, scale, clip, gamma):
    """||sum_D' - sum_D|| = w_{y'} ||clip(g', C)|| <= w_{y'} C <= C for D' = D + one record."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 4, generator=gen) * scale
    y = torch.randint(0, 3, (9,), generator=gen)
    params = (torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen))
    weights = class_weights_from_counts(torch.rand(3, generator=gen) + 0.05, gamma=gamma)
    full = _summed(params, x, y, weights=weights, clip=clip)
    without = _summed(params, x[1:], y[1:], weights=weights, clip=clip)
    diff = (full - without).norm().item()
    assert diff <= weights[y[0]].item() * clip * (1 + 1e-4) + 1e-6
    assert diff <= clip * (1 + 1e-4) + 1e-6


def test_unit_weights_equal_opacus_dpoptimizer():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, generator=gen) * 10, torch.randint(0, 3, (6,), generator=gen)
    params = (torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen))
    ours = _summed(params, x, y, weights=torch.ones(3), clip=0.5)
    theirs = _summed(params, x, y, weights=None, clip=0.5)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_weights_scale_the_clipped_contribution():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(1, 4, generator=gen) * 50, torch.tensor([0])
    params = (torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen))
    weights = torch.tensor([0.25, 1.0, 1.0])
    g = _summed(params, x, y, weights=weights, clip=1.0)
    assert g.norm().item() == pytest.approx(0.25, rel=1e-4)  # clipped to C = 1, then weighted


def test_noise_scale_is_sigma_c_over_expected_batch():
    """With zero gradients, p.grad is pure noise with std sigma * C / expected_batch_size."""
    sigma, clip, batch = 1.7, 0.8, 16
    model = torch.nn.Linear(200, 150)
    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = WeightedDPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.0),
        class_weights=torch.tensor([0.3, 1.0]),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=batch,
        generator=os_seeded_generator(),
    )
    x, y = torch.randn(batch, 200), torch.randint(0, 2, (batch,))
    (gsm(x).sum() * 0.0).backward()
    opt.set_labels(y)
    opt.step()
    noise = model.weight.grad.flatten()
    assert noise.mean().abs().item() < 0.01 * sigma * clip / batch * 10
    assert noise.std().item() == pytest.approx(sigma * clip / batch, rel=0.03)


def test_labels_required_and_checked():
    gsm = GradSampleModule(torch.nn.Linear(2, 2))
    opt = WeightedDPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.1),
        class_weights=torch.tensor([0.5, 1.0]),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=2,
    )
    gsm(torch.randn(2, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="set_labels"):
        opt.step()
    with pytest.raises(ValueError, match="labels outside"):
        opt.set_labels(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        WeightedDPOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=0.1),
            class_weights=torch.tensor([1.5]),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            expected_batch_size=2,
        )


def test_os_randomness_by_default_fixed_seed_warns():
    a, b = os_seeded_generator(), os_seeded_generator()
    assert not torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))
    with pytest.warns(UserWarning, match="testing only"):
        g1 = os_seeded_generator(5)
    with pytest.warns(UserWarning):
        g2 = os_seeded_generator(5)
    assert torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))


def test_engine_make_private_builds_weighted_optimizer_and_accounts():
    from torch.utils.data import DataLoader, TensorDataset

    model = torch.nn.Linear(4, 3)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
    engine = DPSGDPrivacyEngine(class_weights=torch.tensor([0.2, 0.5, 1.0]))
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    assert isinstance(opt, WeightedDPOptimizer) and opt.generator is engine.noise_rng
    assert loader.batch_sampler.generator is engine.secure_rng  # Poisson sampler, OS-seeded
    for x, y in loader:
        if not len(y):
            continue
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.set_labels(y)
        opt.step()
    assert engine.accountant.history and engine.get_epsilon(1e-5) > 0


# ------------------------------------------------------------------------------------------
# Batch-adaptive form: S(B) = sum_c a_c / max(n_c(B), m) * sum_{y_i = c} clip(g_i, C)
# ------------------------------------------------------------------------------------------
def _adaptive_sum(params_data, x, y, *, coefficients, floor, clip):
    """Noise-free S(B) through BatchAdaptiveDPOptimizer (scaled back by sum_c a_c)."""
    model = torch.nn.Linear(x.shape[1], 3)
    with torch.no_grad():
        model.weight.copy_(params_data[0])
        model.bias.copy_(params_data[1])
    gsm = GradSampleModule(model, loss_reduction="mean")
    opt = BatchAdaptiveDPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.0),
        coefficients=coefficients,
        floor=floor,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=1,
        loss_reduction="mean",
    )
    torch.nn.functional.cross_entropy(gsm(x), y).backward()
    opt.set_labels(y)
    opt.step()
    return torch.cat([p.grad.flatten() for p in gsm.parameters()]) * float(sum(coefficients))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 12),
    floor=st.integers(1, 6),
    clip=st.floats(0.05, 5.0),
    scale=st.floats(0.01, 100.0),
)
def test_batch_adaptive_sensitivity_bound(seed, n, floor, clip, scale):
    """||S(B + x') - S(B)|| <= Delta = C max a 2 / (m + 1) for any batch and added record."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 1, 4, generator=gen) * scale
    y = torch.randint(0, 3, (n + 1,), generator=gen)
    params = (torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen))
    coefficients = (torch.rand(3, generator=gen) * 10 + 0.1).tolist()
    full = _adaptive_sum(params, x, y, coefficients=coefficients, floor=floor, clip=clip)
    without = _adaptive_sum(params, x[1:], y[1:], coefficients=coefficients, floor=floor, clip=clip)
    bound = batch_adaptive_sensitivity(clip=clip, coefficients=coefficients, floor=floor)
    assert (full - without).norm().item() <= bound * (1 + 1e-4) + 1e-6


@pytest.mark.parametrize("floor", [1, 2, 5])
def test_batch_adaptive_bound_is_tight(floor):
    """Case (ii) of the proof with s = -n g' and n = m reaches Delta (pure formula check)."""
    a, clip = torch.tensor([2.0, 0.5]), 1.0
    g_new = torch.tensor([clip, 0.0])
    labels = torch.zeros(floor, dtype=torch.long)
    before = (batch_adaptive_factors(labels, coefficients=a, floor=floor)[:, None] * -g_new).sum(0)
    after_labels = torch.zeros(floor + 1, dtype=torch.long)
    grads = torch.cat([-g_new.expand(floor, 2), g_new[None]])
    after = (
        batch_adaptive_factors(after_labels, coefficients=a, floor=floor)[:, None] * grads
    ).sum(0)
    delta = batch_adaptive_sensitivity(clip=clip, coefficients=a, floor=floor)
    assert (after - before).norm().item() == pytest.approx(delta, rel=1e-6)


def test_batch_adaptive_noise_scale_and_checks():
    """With zero gradients p.grad has std sigma * Delta / sum_c a_c."""
    sigma, clip, a, floor = 1.3, 0.7, [6.0, 3.0, 1.0], 2
    model = torch.nn.Linear(200, 150)
    gsm = GradSampleModule(model, loss_reduction="mean")
    opt = BatchAdaptiveDPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.0),
        coefficients=a,
        floor=floor,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=99,
        generator=os_seeded_generator(),
    )
    delta = clip * 6.0 * 2 / 3
    assert opt.sensitivity == pytest.approx(delta) and opt.expected_batch_size == 10.0
    x, y = torch.randn(8, 200), torch.randint(0, 3, (8,))
    (gsm(x).sum() * 0.0).backward()
    opt.set_labels(y)
    opt.step()
    assert model.weight.grad.flatten().std().item() == pytest.approx(sigma * delta / 10.0, rel=0.03)
    with pytest.raises(ValueError, match="floor"):
        batch_adaptive_sensitivity(clip=1.0, coefficients=a, floor=0)
    with pytest.raises(ValueError, match="coefficients"):
        batch_adaptive_sensitivity(clip=1.0, coefficients=[0.0, -1.0], floor=1)
    with pytest.raises(ValueError, match="exclusive"):
        DPSGDPrivacyEngine(
            class_weights=torch.ones(3), batch_adaptive={"coefficients": a, "floor": 1}
        )


def test_opacus_private_helpers_are_the_ones_this_code_was_written_for():
    """Fails loudly (naming the helper) when Opacus renames or changes a private helper."""
    from speechbrain_fl.privacy.weighted_dpsgd import OPACUS_PRIVATE_API, check_opacus_private_api

    check_opacus_private_api()
    assert len(OPACUS_PRIVATE_API) == 6
    # The recipe unwraps the trained model through this attribute (distill/dp_training.py).
    inner = torch.nn.Linear(2, 1)
    assert GradSampleModule(inner)._module is inner
    changed = {**OPACUS_PRIVATE_API, "opacus.optimizers.optimizer:_generate_noise": ("sd",)}
    with pytest.raises(RuntimeError, match="_generate_noise takes"):
        check_opacus_private_api(changed)
    gone = {"opacus.optimizers.optimizer:_no_such_helper": ("x",)}
    with pytest.raises(RuntimeError, match="_no_such_helper is gone.*tested with opacus"):
        check_opacus_private_api(gone)


def test_make_private_refuses_a_sampler_off_the_os_seeded_generator():
    """If Opacus stopped reading ``secure_rng``, the sampler would use the global generator."""
    from torch.utils.data import DataLoader, TensorDataset

    engine = DPSGDPrivacyEngine(accountant="rdp")
    engine.secure_rng = None  # what a renamed Opacus attribute would leave in effect
    model = torch.nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8).long()), batch_size=4)
    with pytest.raises(RuntimeError, match="Poisson sampler does not use"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )

"""The sensitivity bound of updates encoded for SecAgg+ (speechbrain_fl/privacy/secure_encoding.py).

A client clips to the shrunk budgets C_l' = C_l - sqrt(p_l) 2c/T, then Flower's own SecAgg+
quantiser (stochastic rounding into [0, T]) encodes it; the decoded update must keep every group
within C_l and the whole update within C, for every clip method. A coarse T makes the rounding
large enough that clipping to C_l itself would break the bound (checked too).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.common.secure_aggregation.quantization import dequantize, quantize

from speechbrain_fl.privacy import EMABudgetState, Group, Layout, clip_update, compute_budgets
from speechbrain_fl.privacy.secure_encoding import (
    encoding_box,
    quantization_range,
    shrunk_budgets,
)

LAYOUT = Layout(
    [
        Group("enc.w", "encoder", 64),
        Group("enc.b", "encoder", 8),
        Group("con.w", "connector", 48),
        Group("llm.a", "llm", 96),
        Group("llm.b", "llm", 16),
    ]
)
CLIP = 1.0


def _budgets(method: str):
    if method == "alpha_split":
        return compute_budgets(LAYOUT, method=method, clip=CLIP, alpha=0.3)
    if method.endswith("_ema"):
        state = EMABudgetState(LAYOUT, base="dim" if "dim" in method else "uniform",
                               warmup_rounds=0)  # fmt: skip
        state.update({g.name: float(i + 1) for i, g in enumerate(LAYOUT)})
        return compute_budgets(LAYOUT, method=method, clip=CLIP, ema_state=state)
    return compute_budgets(LAYOUT, method=method, clip=CLIP)


def _encode_decode(update, box: float, target_range: int):
    """Flower's quantiser and dequantiser on one client's update (the mod's and the server's)."""
    names = list(update)
    arrays = [update[n].double().numpy() for n in names]
    decoded = dequantize(quantize(arrays, box, target_range), box, target_range)
    return {n: torch.from_numpy(np.asarray(d)) for n, d in zip(names, decoded, strict=True)}


def _norms(update, budgets):
    if not isinstance(budgets, dict):
        joint = math.sqrt(sum(float(v.double().pow(2).sum()) for v in update.values()))
        return {"(flat)": joint}, joint
    groups = {n: float(update[n].double().norm()) for n in budgets}
    return groups, math.sqrt(sum(v**2 for v in groups.values()))


@pytest.mark.parametrize(
    "method", ["flat", "pfl_uniform", "pfl_dim", "pfl_dim_ema", "pfl_unif_ema", "alpha_split"]
)
def test_decoded_updates_stay_within_every_budget(method):
    budgets = _budgets(method)
    target_range = 2**8  # coarse on purpose: one step is 2c/256
    shrunk, box = shrunk_budgets(budgets, layout=LAYOUT, target_range=target_range)
    assert box == encoding_box(budgets)
    gen = torch.Generator().manual_seed(0)
    np.random.seed(0)  # the quantiser's stochastic rounding draws from NumPy's global RNG
    for trial in range(200):
        scale = [0.01, 1.0, 100.0][trial % 3]  # under, near and far over the budgets
        update = {g.name: scale * torch.randn(g.numel, generator=gen) for g in LAYOUT}
        clipped, _ = clip_update(update, shrunk, layout=LAYOUT)
        decoded = _encode_decode(clipped, box, target_range)
        groups, joint = _norms(decoded, budgets)
        assert joint <= CLIP * (1 + 1e-12), (trial, joint)
        for name, norm in groups.items():
            bound = budgets if not isinstance(budgets, dict) else budgets[name]
            assert norm <= bound * (1 + 1e-12), (trial, name, norm, bound)


def test_clipping_to_the_budget_itself_breaks_the_bound():
    """Why the budgets are shrunk: the rounding alone pushes updates at C past C."""
    target_range = 2**6
    gen = torch.Generator().manual_seed(1)
    np.random.seed(1)
    over = 0
    for _ in range(200):
        update = {g.name: torch.randn(g.numel, generator=gen) for g in LAYOUT}
        clipped, _ = clip_update(update, CLIP, layout=LAYOUT)
        _, joint = _norms(_encode_decode(clipped, CLIP, target_range), CLIP)
        over += joint > CLIP
    assert over > 50


def test_budgets_too_small_for_the_step_are_refused():
    layout = Layout([Group("big", "all", 10**6), Group("tiny", "all", 1)])
    with pytest.raises(ValueError, match="leaves no budget for groups"):
        shrunk_budgets({"big": 1.0, "tiny": 1e-6}, layout=layout, target_range=2**10)
    with pytest.raises(KeyError, match="layout does not have"):
        shrunk_budgets({"nope": 1.0}, layout=layout, target_range=2**10)


@pytest.mark.parametrize("cohort", [1, 2, 3, 7, 100, 255, 256, 1000, 4095])
def test_quantization_range_keeps_the_sum_in_the_field(cohort):
    target_range = quantization_range(cohort)
    assert (cohort + 1) * target_range <= 2**32  # m values in [0, T] plus m weights T
    assert target_range <= 2**24 and target_range & (target_range - 1) == 0


def test_quantization_range_refuses_cohorts_that_leave_too_few_bits():
    with pytest.raises(ValueError, match="lower sampling_rate"):
        quantization_range(2**25)

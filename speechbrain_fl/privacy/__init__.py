"""Component-aware differential privacy for federated speech models (no Flower, no SpeechBrain).

Layouts of trainable groups, per-group clip budgets (flat, PFL-Uniform, PFL-Dim, their EMA
variants and N-pool alpha-split), vectorised clipping with statistics, the Gaussian mechanism on
the aggregate, (epsilon, delta) accounting (dp-accounting's PLD by default, Opacus's RDP and
PRV) and the empirical canary audit (:mod:`.audit`, torch/numpy/scipy). See ``docs/api.md`` for the
contracts and the alpha-split paper (Section IV) for the formulas.
"""

from .accounting import (
    PrivacyAccountant,
    component_privacy,
    compute_epsilon,
    effective_noise_multipliers,
    extrapolate_privacy,
    noise_multiplier_for_epsilon,
)
from .alpha_choice import select_alpha
from .audit import CanarySet, one_run_lower_bound, one_shot_epsilon
from .budgets import (
    METHODS,
    BudgetMethod,
    EMABudgetState,
    Pool,
    alpha_split_pools,
    budget_methods,
    component_budgets,
    compute_budgets,
    get_budget_method,
    register_budget_method,
)
from .clipping import ClipStats, clip_update
from .layout import Group, Layout, layout_from_model
from .noise import GaussianNoise, noise_std, noisy_norm_signal

__all__ = [
    "Group",
    "Layout",
    "layout_from_model",
    "METHODS",
    "BudgetMethod",
    "budget_methods",
    "get_budget_method",
    "register_budget_method",
    "Pool",
    "compute_budgets",
    "alpha_split_pools",
    "EMABudgetState",
    "component_budgets",
    "select_alpha",
    "clip_update",
    "ClipStats",
    "GaussianNoise",
    "noise_std",
    "noisy_norm_signal",
    "compute_epsilon",
    "noise_multiplier_for_epsilon",
    "PrivacyAccountant",
    "effective_noise_multipliers",
    "component_privacy",
    "extrapolate_privacy",
    "CanarySet",
    "one_shot_epsilon",
    "one_run_lower_bound",
]

from .methods import (  # noqa: E402 (the method objects, after the registry they name)
    AlphaSplit,
    FedAvg,
    Flat,
    PFLDim,
    PFLDimEMA,
    PFLUnifEMA,
    PFLUniform,
    PrivacyMethod,
    privacy_method,
)

__all__ += ["PrivacyMethod", "FedAvg", "Flat", "PFLUniform", "PFLDim", "PFLDimEMA", "PFLUnifEMA"]
__all__ += ["AlphaSplit", "privacy_method"]

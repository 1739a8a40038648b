"""The privacy mechanism of a run: cohort sampler, Gaussian noise, accountant, EMA budgets.

:func:`privacy_mechanism` builds the four stateful parts :class:`~speechbrain_fl.fl.serverapp.strategy.DPFedAvg` runs a
round with, from the :class:`~speechbrain_fl.fl.settings.config.FLConfig`: the Poisson sampler of rate q, the noise
N(0, (sigma C / n)^2) and the accountant of a private run (``noise_multiplier > 0``), and the
EMA budget state of an adaptive method (``pfl_dim_ema``, ``pfl_unif_ema``, or any method
registered with an ``ema_base``). A simulated deployment (``noise_cohort_size`` M,
``accounting_population`` N) gets the noise N(0, (sigma C / M)^2) on the mean and an accountant
at q = M / N; its sampler stays this run's (rate q of the K partitions).
"""

from __future__ import annotations

from logging import WARNING

from flwr.common.logger import log

from speechbrain_fl.fl.dp.sampling import PoissonSampler
from speechbrain_fl.fl.settings.config import FLConfig, ema_base_of
from speechbrain_fl.privacy import EMABudgetState, GaussianNoise, Layout, PrivacyAccountant

__all__ = ["privacy_mechanism"]


def cohort_sampler(config: FLConfig) -> PoissonSampler:
    """The Poisson sampler of rate q.

    A private run draws its seed from the OS unless ``sampler_seed`` is set (warned, with a
    fixed ``noise_seed``: tests only); a non-private run makes no privacy claim, and its
    public ``seed`` gives reproducible cohorts.
    """
    if config.private:
        sampler_seed = config.sampler_seed
        for key in ("sampler_seed", "noise_seed"):
            if getattr(config, key) is not None:
                log(
                    WARNING,
                    "%s=%s is fixed: cohorts or noise are predictable; for testing only, "
                    "not private (recorded in results.json privacy.caveats)",
                    key,
                    getattr(config, key),
                )
    else:
        sampler_seed = config.seed if config.sampler_seed is None else config.sampler_seed
    return PoissonSampler(config.sampling_rate, seed=sampler_seed)


def ema_budgets(config: FLConfig, layout: Layout) -> EMABudgetState | None:
    """The EMA budget state of an adaptive method with a clip (None otherwise)."""
    base = ema_base_of(config.method) if config.clip is not None else None
    if base is None:
        return None
    if config.ema_signal == "raw":
        log(
            WARNING,
            "ema_signal='raw': the EMA budgets use raw client norms, which is "
            "OUTSIDE the differential-privacy guarantee (paper reproduction only)",
        )
    return EMABudgetState(
        layout,
        base=base,
        beta=config.ema_beta,
        gamma=config.ema_gamma,
        warmup_rounds=config.ema_warmup_rounds,
        signal=config.ema_signal,
    )


def privacy_mechanism(
    config: FLConfig, layout: Layout
) -> tuple[PoissonSampler, GaussianNoise | None, PrivacyAccountant | None, EMABudgetState | None]:
    """``(sampler, noise, accountant, ema)`` of a run; noise and accountant only when private.

    Example
    -------
    >>> from speechbrain_fl.privacy import Group
    >>> cfg = FLConfig(output_folder="o", noise_multiplier=1.0, clip=1.0, method="pfl_dim_ema")
    >>> sampler, noise, accountant, ema = privacy_mechanism(cfg, Layout([Group("w", "all", 3)]))
    >>> noise is not None, accountant is not None, ema is not None
    (True, True, True)
    """
    sampler = cohort_sampler(config)
    noise = accountant = None
    if config.private:
        noise = GaussianNoise(
            noise_multiplier=config.noise_multiplier,
            clip=config.clip,
            seed=config.noise_seed,
            noise_cohort_size=config.noise_cohort_size,
        )
        if config.simulated_deployment:
            log(
                WARNING,
                "simulated deployment: noise of a cohort of noise_cohort_size=%d (std sigma C / "
                "%d on the mean) and epsilon at q = %d / accounting_population=%d; the epsilon "
                "is the simulated deployment's, not this run's clients'",
                config.noise_cohort_size,
                config.noise_cohort_size,
                config.noise_cohort_size,
                config.accounting_population,
            )
        accountant = PrivacyAccountant(
            sampling_rate=config.accounting_sampling_rate,
            noise_multiplier=config.noise_multiplier,
            delta=config.delta,
            accountant=config.accountant,
        )
    return sampler, noise, accountant, ema_budgets(config, layout)

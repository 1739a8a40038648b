"""The server strategy's privacy state: budgets, epsilon, EMA updates and the state a resume keeps.

:class:`PrivacyStateMixin` holds the methods of :class:`~speechbrain_fl.fl.serverapp.strategy.DPFedAvg`
that read or restore its privacy mechanism (built by :func:`speechbrain_fl.fl.dp.mechanism.privacy_mechanism`):
this round's clip budgets, the epsilon spent (the guarantee's figure and the running per-round
one), the disclosure, the EMA budgets' update from a released round, the canary audit's report,
and the state a resumed run needs.

Randomness (docs/design.md "Privacy invariants"): a private run draws the cohort sampler's and
the noise's seeds from the OS and keeps them in memory only; ``seed`` seeds the clients'
training only. :meth:`PrivacyStateMixin.state_dict` holds the accountant, the EMA budgets and
the privacy settings, nothing from which past cohorts or noise could be derived; a resume with
other privacy settings is refused (:meth:`PrivacyStateMixin.load_state_dict`).

Adaptive clipping (``clip_quantile``, :mod:`speechbrain_fl.fl.dp.adaptive`): the round's budgets
come from the pools' current clips; each counted reply carries its ``clip-bits`` (checked in
:meth:`PrivacyStateMixin._parse`, a reply without valid bits is dropped), and after the noise
:meth:`PrivacyStateMixin.adapt_clip` releases the noisy counts and moves the clips; under SecAgg+
the bit sums come from the secure sum (:mod:`speechbrain_fl.fl.secagg.train_stage`).

EMA budgets (step 6 of a round, :mod:`speechbrain_fl.fl.serverapp.strategy`): updated from ``noisy_norm_signal`` of the
released aggregate (post-processing) or, with ``ema_signal="raw"``, from the clients' reported
norms (outside the DP guarantee).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log

from speechbrain_fl.fl.aggregate.round_report import RoundReport
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.dp.adaptive import (
    adaptive_columns,
    adaptive_privacy,
    adaptive_state,
    pools_message,
    round_budgets,
    round_row,
    rounds_clips,
)
from speechbrain_fl.fl.dp.canaries import FederatedAudit
from speechbrain_fl.fl.dp.disclosure import privacy_disclosure, simulated_deployment
from speechbrain_fl.fl.dp.sampling import PoissonSampler
from speechbrain_fl.fl.serverapp.replies import ReplyRejected
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.settings.resume import check_privacy_settings, privacy_settings
from speechbrain_fl.privacy import (
    EMABudgetState,
    GaussianNoise,
    Layout,
    PrivacyAccountant,
    compute_budgets,
    noisy_norm_signal,
)
from speechbrain_fl.privacy.adaptive_clipping import QuantileClipState, check_bits

__all__ = ["PrivacyStateMixin"]


class PrivacyStateMixin:
    """Budgets, epsilon, EMA updates, audit report and resume state of a DP strategy.

    Mixed into :class:`~speechbrain_fl.fl.serverapp.strategy.DPFedAvg`, which sets the attributes
    annotated below in its ``__init__``.
    """

    config: FLConfig
    layout: Layout
    population_size: int | None
    sampler: PoissonSampler
    noise: GaussianNoise | None
    accountant: PrivacyAccountant | None
    ema: EMABudgetState | None
    seed_rng: np.random.Generator
    audit: FederatedAudit | None
    _population_warned: int | None
    _round_figure: tuple[tuple[int, str], float] | None
    #: adaptive clipping (``clip_quantile``): the clips' state, the pools, sigma_Delta
    adaptive: QuantileClipState | None = None
    adaptive_pools: dict[str, list[str]] | None = None
    update_noise_multiplier: float | None = None

    def init_adaptive(self) -> None:
        """Set up adaptive clipping when ``clip_quantile`` is set: the clips' state, and the
        update's noise at sigma_Delta (Theorem 1) on the current total clip."""
        if self.config.clip_quantile is None or self.noise is None:
            return
        self.adaptive, sigma, self.adaptive_pools = adaptive_state(
            self.config, self.layout, expected_cohort_size=self.expected_cohort_size()
        )
        self.update_noise_multiplier = sigma
        self.noise = GaussianNoise(
            noise_multiplier=sigma,
            clip=self.adaptive.total_clip,
            seed=self.config.noise_seed,
            noise_cohort_size=self.config.noise_cohort_size,
        )
        log(
            INFO,
            "adaptive clipping: pools %s start at %s, target quantile %g, lr %g, count noise "
            "std %g; the update's noise multiplier is %.4g so that update and count spend %g",
            list(self.adaptive.pools),
            {p: round(c, 6) for p, c in self.adaptive.clips.items()},
            self.adaptive.quantile,
            self.adaptive.learning_rate,
            self.adaptive.count_stddev,
            sigma,
            self.config.noise_multiplier,
        )

    def adaptive_message(self) -> str | None:
        """The round's ``clip-quantile-pools`` for the clients (``None`` without adaptation)."""
        if self.adaptive is None:
            return None
        return pools_message(self.adaptive, self.adaptive_pools)

    def adaptive_columns(self) -> list[str]:
        """The ``rounds.csv`` columns of adaptive clipping (none without it)."""
        return [] if self.adaptive is None else adaptive_columns(self.adaptive.pools)

    def _parse(self, message, shapes, limits):
        """The reply checks, then its ``clip-bits`` under adaptive clipping (0/1 per pool)."""
        update = super()._parse(message, shapes, limits)
        if self.adaptive is not None:
            try:
                check_bits(update.metrics.get("clip-bits"), len(self.adaptive.pools))
            except ValueError as err:
                raise ReplyRejected(f"node {update.node_id}: metric 'clip-bits' {err}") from None
        return update

    def adapt_clip(self, bit_sums: list[float], *, num_counted: int, report: RoundReport) -> None:
        """Release the noisy unclipped fractions of the round and move the clips.

        ``bit_sums`` per pool (in the pools' order) over the ``num_counted`` clients counted
        (those whose update is in the aggregate); the round's clips and fractions go into the
        report's ``extra`` (``rounds.csv``), the noise follows the new total clip.
        """
        used = dict(self.adaptive.clips)
        fractions = self.adaptive.step(
            dict(zip(self.adaptive.pools, bit_sums, strict=True)),
            expected_cohort_size=self.expected_cohort_size(),
            num_counted=num_counted,
            noise_cohort_size=self.config.noise_cohort_size,
        )
        report.extra.update(round_row(used, fractions))
        self.noise.set_clip(self.adaptive.total_clip)

    def central_bit_sums(self, updates: list[ClientUpdate]) -> list[float]:
        """Per pool, the sum of the counted replies' bits (checked by :meth:`_parse`)."""
        sums = [0.0] * len(self.adaptive.pools)
        for update in updates:
            for i, bit in enumerate(update.metrics["clip-bits"]):
                sums[i] += float(bit)
        return sums

    def privacy_extras(self, round_component_budgets) -> dict[str, Any]:
        """results.json ``privacy`` entries beside the accountant's report: a simulated
        deployment's description (the epsilon is that deployment's), and adaptive clipping's
        per-pool figures and clips (:func:`speechbrain_fl.fl.dp.adaptive.adaptive_privacy`)."""
        extras: dict[str, Any] = {}
        simulated = simulated_deployment(self.config)
        if simulated is not None:
            extras["simulated_deployment"] = simulated
        if self.adaptive is None:
            return extras
        return extras | adaptive_privacy(
            self.adaptive,
            layout=self.layout,
            round_clips=rounds_clips(self.config.output_folder, self.adaptive.pools),
            round_component_budgets=round_component_budgets,
            update_noise_multiplier=self.update_noise_multiplier,
            sampling_rate=self.accountant.sampling_rate,
            delta=self.config.delta,
            accountant=self.config.accountant,
            rounds=self.accountant.rounds,
        )

    def budgets(self) -> float | dict[str, float] | None:
        """Return this round's clip budgets (``None`` when clipping is off)."""
        if self.config.clip is None:
            return None
        if self.adaptive is not None:
            return round_budgets(
                self.adaptive, self.layout, method=self.config.method, pools=self.adaptive_pools
            )
        return compute_budgets(
            self.layout,
            method=self.config.method,
            clip=self.config.clip,
            alpha=self.config.alpha,
            ema_state=self.ema,
        )

    def epsilon(self) -> float | None:
        """Return epsilon spent so far from the run's accountant (``None``: not private).

        This is the guarantee's figure (``config.accountant``, PLD by default): results.json
        and the final :class:`~speechbrain_fl.fl.serverapp.task.ServerResult` report it.
        """
        return None if self.accountant is None else float(self.accountant.epsilon())

    def round_epsilon(self) -> tuple[float, str] | None:
        """Return ``(epsilon so far, accountant)`` of the running per-round figure.

        From ``config.round_accountant`` (default ``"rdp"``: a cached per-step RDP times the
        rounds and one conversion, instead of the PLD's ``T``-fold self-composition every
        round); ``None`` for a non-private run. Same mechanism and rounds as :meth:`epsilon`,
        another (upper) bound: the figure always travels with its accountant's name.
        """
        if self.accountant is None:
            return None
        name = self.config.round_accountant
        key = (self.accountant.rounds, name)
        if self._round_figure is None or self._round_figure[0] != key:
            # once per round: the strategy's metrics and the server's row ask for the same one
            self._round_figure = (key, float(self.accountant.epsilon(accountant=name)))
        return self._round_figure[1], name

    def expected_cohort_size(self) -> float:
        """Return n = qK with the declared population K (``None`` K: not a private run)."""
        if self.population_size is None:
            raise ValueError("no declared population: set population_size")
        return self.sampler.expected_cohort_size(self.population_size)

    def disclosure(self, *, profile_rounds: int = 0, alpha_from_profile: bool = False) -> dict:
        """What the run's epsilon covers and what it does not (for results.json ``privacy``).

        See :func:`speechbrain_fl.fl.dp.disclosure.privacy_disclosure`.
        """
        return privacy_disclosure(
            self.config, profile_rounds=profile_rounds, alpha_from_profile=alpha_from_profile
        )

    def privacy_settings(self) -> dict[str, Any]:
        """The settings a resumed run must keep: C, delta, q, sigma, method, layout, K."""
        return privacy_settings(
            self.config, population_size=self.population_size, layout=self.layout
        )

    def state_dict(self) -> dict[str, Any]:
        """Return what a resumed run needs: accountant, EMA budgets, settings, training seeds.

        Never the sampler's or the noise's seed or generator state (nothing from which past
        cohorts or noise could be derived).
        """
        return {
            "privacy": self.privacy_settings(),
            "seed_rng": self.seed_rng.bit_generator.state,
            "noise": None if self.noise is None else self.noise.state_dict(),
            "accountant": None if self.accountant is None else self.accountant.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
        }

    def check_privacy_settings(self, saved: dict[str, Any] | None, *, source: str) -> None:
        """Raise ``ValueError`` naming the first privacy setting that differs from ``saved``."""
        check_privacy_settings(self.privacy_settings(), saved, source=source)

    def load_state_dict(self, state: dict[str, Any], *, source: str = "saved server state") -> None:
        """Restore what :meth:`state_dict` saved, refusing changed privacy settings.

        Arguments
        ---------
        state : dict
            The saved state.
        source : str
            The state file, named in errors.
        """
        self.check_privacy_settings(state.get("privacy"), source=source)
        self.seed_rng.bit_generator.state = state["seed_rng"]
        for name in ("noise", "accountant", "ema", "adaptive"):
            obj = getattr(self, name)
            if (obj is None) != (state.get(name) is None):
                raise ValueError(
                    f"{source} has {name}={state.get(name) is not None}, "
                    f"but the config gives {obj is not None}: config changed?"
                )
            if obj is not None:
                obj.load_state_dict(state[name])
        if self.adaptive is not None:  # the restored clips' total
            self.noise.set_clip(self.adaptive.total_clip)

    def check_population(self, connected: int) -> None:
        """Warn (once per count) when the connected nodes differ from the declared K."""
        if self.population_size is None or connected == self.population_size:
            return
        if self._population_warned != connected:
            self._population_warned = connected
            log(
                WARNING,
                "population_size=%d is declared but %d nodes connected: the noise and the "
                "accountant use the declared K (n = qK = %.4g); %s",
                self.population_size,
                connected,
                self.expected_cohort_size(),
                "missing nodes count as non-replies"
                if connected < self.population_size
                else "raise population_size if these nodes belong to the population",
            )

    def audit_report(self, params: Mapping[str, torch.Tensor], *, confidence: float = 0.95):
        """The canary audit of the rounds run (:meth:`speechbrain_fl.fl.dp.canaries.FederatedAudit.report`).

        ``None`` without ``audit_canaries`` or before any audited round.
        """
        if self.audit is None:
            return None
        return self.audit.report(
            params, expected_cohort_size=self.expected_cohort_size(), confidence=confidence
        )

    def _update_ema(
        self, updates: list[ClientUpdate], aggregate: dict[str, torch.Tensor], report: RoundReport
    ) -> None:
        """Step 6: update the EMA budgets from the released aggregate's noisy group norms
        (``noisy_norm_signal`` with the round's noise std), or from the clients' reported
        ``group-norms`` with ``ema_signal="raw"``; non-finite observations are left out."""
        if self.config.ema_signal == "raw":
            observed = report.group_norms
            if not updates:
                log(WARNING, "round %d: no replies, the raw EMA signal is skipped", report.round)
                return
            if not observed:
                raise ValueError("ema_signal='raw' needs the clients' 'group-norms' metric")
        else:
            std = report.noise_std or 0.0
            observed = noisy_norm_signal(aggregate, self.layout, std=std)
        self.ema.update({k: float(v) for k, v in observed.items() if math.isfinite(float(v))})

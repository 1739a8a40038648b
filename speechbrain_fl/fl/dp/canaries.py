"""The canary audit's clients on the server (``audit_canaries: m`` > 0, private runs).

:class:`FederatedAudit` is what :class:`~speechbrain_fl.fl.serverapp.strategy.DPFedAvg` holds for the
audit of :mod:`speechbrain_fl.privacy.audit`:

- at the first round this process runs, ``m`` canary directions over the trainable tensors
  and their inserted/held-out split are drawn from the OS and kept in memory only (never in
  ``server_state.pt`` or results.json), and the global tensors are kept as the audit's start;
- every round, each inserted canary is drawn by the run's own
  :class:`~speechbrain_fl.fl.dp.sampling.PoissonSampler` (rate q, draw key ``(round, 0, 1)``,
  apart from the clients' ``(round, attempt)``), and a drawn one becomes a
  :class:`~speechbrain_fl.fl.aggregate.update.ClientUpdate` at the clip bound, re-clipped by the
  server like any reply; the strategy sums it with the replies before the noise, which stays
  calibrated to n = qK real clients (the canaries are not users; the accountant's epsilon is
  unchanged);
- :meth:`FederatedAudit.report` scores the canaries against the model delta since the start.

A resumed run audits the rounds since the resume, with fresh canaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log

from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.dp.sampling import PoissonSampler
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy import CanarySet, Layout, clip_update, compute_epsilon
from speechbrain_fl.privacy.audit import audit_summary

__all__ = ["FederatedAudit"]


class FederatedAudit:
    """Canary clients of one private run, their per-round updates and the final audit.

    Arguments
    ---------
    config : FLConfig
        The run's settings (``audit_canaries``, ``clip``, ``sampling_rate``, ...).
    layout : Layout
        The trainable groups (per-group budgets scale a canary's parts).
    sampler : PoissonSampler
        The run's cohort sampler, which draws the canaries too.
    """

    def __init__(self, config: FLConfig, layout: Layout, sampler: PoissonSampler) -> None:
        self.config = config
        self.layout = layout
        self.sampler = sampler
        self.canaries: CanarySet | None = None
        self._start: dict[str, torch.Tensor] | None = None
        self.rounds = 0
        self.insertions = 0

    def updates(
        self, server_round: int, global_params: Mapping[str, torch.Tensor], budgets
    ) -> list[ClientUpdate]:
        """This round's Poisson-drawn inserted canaries, each at the clip bound, re-clipped."""
        if self.canaries is None:
            shapes = {k: tuple(v.shape) for k, v in global_params.items()}
            self.canaries = CanarySet(self.config.audit_canaries, shapes)
            self._start = {
                k: v.detach().to(torch.float64).clone() for k, v in global_params.items()
            }
            log(
                INFO,
                "audit: %d canaries (%d inserted, split and directions from the OS, in memory "
                "only) from round %d",
                self.canaries.num_canaries,
                len(self.canaries.inserted),
                server_round,
            )
        drawn = self.sampler.sample(self.canaries.inserted, order={}, draw=(server_round, 0, 1))
        out = []
        for index in drawn:
            delta = {
                k: v.to(global_params[k].dtype)
                for k, v in self.canaries.update(index, budgets, layout=self.layout).items()
            }
            # the server's enforcement of the budgets, as for every reply (contract 3)
            delta, _ = clip_update(delta, budgets, layout=self.layout, inplace=True)
            out.append(ClientUpdate(-1 - index, delta, {}))
        self.rounds += 1
        self.insertions += len(out)
        return out

    def report(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        expected_cohort_size: float,
        confidence: float = 0.95,
    ) -> tuple[dict[str, Any], np.ndarray, np.ndarray] | None:
        """Score the canaries against the model delta of the audited rounds.

        Arguments
        ---------
        params : mapping of str to Tensor
            The global trainable tensors after the last round.
        expected_cohort_size : float
            n = qK (recorded beside the canary insertions, their weight in the sum).
        confidence : float
            Of the one-run lower bound.

        Returns
        -------
        tuple or None
            ``(summary, cosines, is_inserted)``: :func:`speechbrain_fl.privacy.audit.audit_summary`
            beside the accountant's epsilon for the audited rounds, and the in-memory scores for
            the plot; ``None`` when no round was audited.
        """
        if self.canaries is None or self._start is None or not self.rounds:
            return None
        delta_model = {k: params[k].detach().to(torch.float64) - v for k, v in self._start.items()}
        cosines = self.canaries.cosines(delta_model)
        cfg = self.config
        eps = compute_epsilon(
            sampling_rate=cfg.sampling_rate,
            noise_multiplier=cfg.noise_multiplier,
            rounds=self.rounds,
            delta=cfg.delta,
            accountant=cfg.accountant,
            warn=False,
        )
        summary = audit_summary(
            cosines,
            self.canaries.is_inserted,
            delta=cfg.delta,
            accountant_epsilon=eps,
            rounds=self.rounds,
            confidence=confidence,
            insertions=self.insertions,
        )
        summary["accountant"] = cfg.accountant
        summary["expected_cohort_size"] = expected_cohort_size
        return summary, cosines, self.canaries.is_inserted

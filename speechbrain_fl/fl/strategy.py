"""Server strategy: Poisson sampling, server-side re-clipping, pluggable aggregation, noise.

:class:`DPFedAvg` subclasses Flower's message-based :class:`flwr.serverapp.strategy.FedAvg` and
overrides only ``configure_train`` and ``aggregate_train`` (federated evaluation is switched off
with ``fraction_evaluate=0``; the server evaluates centrally, see :mod:`.server`). Why not wrap
FedAvg with Flower's ``DifferentialPrivacyServerSideFixedClipping``: that wrapper clips the whole
model with one norm, samples a fixed count, averages over the realised replies and accounts only
without amplification, whereas the contracts here need per-group budgets (DESIGN.md 2-3),
Poisson sampling with a fixed denominator n = qK (contract 4) and an RDP accountant with
subsampling (contract 5). The structure is the same as Flower's wrapper: keep the global arrays
seen in ``configure_train``, clip every reply, aggregate, add noise once, return global + update.

One round, for replies u_1..u_m of a cohort drawn with rate q from K nodes (n = qK):

1. reject faulty replies (:mod:`.replies`); fewer than ``min_clients`` valid -> :class:`RoundFailed`;
2. re-clip: u_i <- clip(u_i, C_l) per group, so a client that skipped clipping cannot raise the
   sensitivity above C (contract 3);
3. aggregate with the rule (default DP rule sum_i u_i / n, McMahan et al. 2018, Alg. 1);
4. add N(0, (sigma C / n)^2 I) once (contract 4), one accountant step;
5. EMA budgets: update from ``noisy_norm_signal`` of the released aggregate (post-processing) or,
   with ``ema_signal="raw"``, from the clients' reported norms (outside the DP guarantee);
6. theta <- theta + update; a non-finite result raises instead of being applied.

Clients receive their budgets in the round's ConfigRecord as JSON (``clip-budgets``: a float
for ``flat`` or ``{group: C_l}``), not the method and EMA state: clients then need no privacy
state, cannot drift from the server's budgets, and a resumed server sends the same numbers.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from speechbrain_fl.privacy import (
    EMABudgetState,
    GaussianNoise,
    Layout,
    PrivacyAccountant,
    clip_update,
    component_budgets,
    compute_budgets,
    noise_std,
    noisy_norm_signal,
)

from .aggregation import ClientUpdate, get_rule
from .config import EMA_METHODS, FLConfig
from .replies import ReplyRejected, parse_train_reply
from .sampling import PoissonSampler

__all__ = ["DPFedAvg", "RoundFailed", "RoundReport"]


class RoundFailed(RuntimeError):
    """Fewer than ``min_clients`` valid replies; the round may be retried."""


@dataclass
class RoundReport:
    """What one aggregated round did (the source of a ``rounds.csv`` row)."""

    round: int
    cohort_size: int
    population: int
    num_replied: int
    num_failed: int
    failures: list[str] = field(default_factory=list)
    noise_std: float | None = None
    joint_norm_mean: float | None = None
    clip_rate: float | None = None
    mean_clip_ratio: float | None = None
    train_loss: float | None = None
    group_norms: dict[str, float] = field(default_factory=dict)
    group_clip_rates: dict[str, float] = field(default_factory=dict)
    group_budgets: dict[str, float] = field(default_factory=dict)
    component_norms: dict[str, float] = field(default_factory=dict)
    component_clip_rates: dict[str, float] = field(default_factory=dict)
    component_budgets: dict[str, float] = field(default_factory=dict)


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


class DPFedAvg(FedAvg):
    """FedAvg with Poisson sampling, per-group clipping, central Gaussian noise and accounting.

    Arguments
    ---------
    config : FLConfig
        Federated and privacy settings.
    layout : speechbrain_fl.privacy.Layout
        Trainable groups of the model (names, components, sizes).
    min_available_nodes : int
        Nodes to wait for before sampling (the population K is the connected set).

    Example
    -------
    >>> from speechbrain_fl.privacy import Group, Layout
    >>> cfg = FLConfig(output_folder="out", sampling_rate=0.5, noise_multiplier=1.0, clip=1.0)
    >>> strategy = DPFedAvg(config=cfg, layout=Layout([Group("w", "all", 3)]))
    >>> strategy.budgets()
    1.0
    """

    def __init__(self, *, config: FLConfig, layout: Layout, min_available_nodes: int = 1) -> None:
        super().__init__(
            fraction_train=config.sampling_rate,
            fraction_evaluate=0.0,
            min_train_nodes=config.min_clients,
            min_available_nodes=min_available_nodes,
        )
        self.config = config
        self.layout = layout
        self.rule = get_rule(config.aggregation or config.aggregation_rule_name)
        if config.private and not getattr(self.rule, "dp_sensitivity_bounded", False):
            raise ValueError(
                f"aggregation {config.aggregation_rule_name!r} does not declare "
                "dp_sensitivity_bounded=True, so the noise would not cover its sensitivity"
                + (f" ({self.rule.dp_refusal})" if getattr(self.rule, "dp_refusal", None) else "")
                + "; use 'uniform' for private runs"
            )
        self.sampler = PoissonSampler(config.sampling_rate, seed=config.seed)
        self.seed_rng = np.random.default_rng(None if config.seed is None else config.seed + 1)
        self.noise = (
            GaussianNoise(
                noise_multiplier=config.noise_multiplier, clip=config.clip, seed=config.noise_seed
            )
            if config.private
            else None
        )
        self.accountant = (
            PrivacyAccountant(
                sampling_rate=config.sampling_rate,
                noise_multiplier=config.noise_multiplier,
                delta=config.delta,
                accountant=config.accountant,
            )
            if config.private
            else None
        )
        self.ema = None
        if config.clip is not None and config.clip_method in EMA_METHODS:
            self.ema = EMABudgetState(
                layout,
                base=EMA_METHODS[config.clip_method],
                beta=config.ema_beta,
                gamma=config.ema_gamma,
                warmup_rounds=config.ema_warmup_rounds,
            )
            if config.ema_signal == "raw":
                log(
                    WARNING,
                    "ema_signal='raw': the EMA budgets use raw client norms, which is "
                    "OUTSIDE the differential-privacy guarantee (paper reproduction only)",
                )
        self.current_arrays: ArrayRecord | None = None
        self.cohort: list[int] = []
        self.population = 0
        self.node_order: dict[int, int] = {}
        self.last_report: RoundReport | None = None

    # ------------------------------------------------------------------ budgets, state
    def budgets(self) -> float | dict[str, float] | None:
        """Return this round's clip budgets (``None`` when clipping is off)."""
        if self.config.clip is None:
            return None
        return compute_budgets(
            self.layout,
            method=self.config.clip_method,
            clip=self.config.clip,
            alpha=self.config.alpha,
            ema_state=self.ema,
        )

    def epsilon(self) -> float | None:
        """Return epsilon spent so far (``None`` for a non-private run)."""
        return None if self.accountant is None else float(self.accountant.epsilon())

    def state_dict(self) -> dict[str, Any]:
        """Return everything a resumed run needs to continue identically."""
        return {
            "sampler": self.sampler.state_dict(),
            "seed_rng": self.seed_rng.bit_generator.state,
            "noise": None if self.noise is None else self.noise.state_dict(),
            "accountant": None if self.accountant is None else self.accountant.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.sampler.load_state_dict(state["sampler"])
        self.seed_rng.bit_generator.state = state["seed_rng"]
        for name in ("noise", "accountant", "ema"):
            obj = getattr(self, name)
            if (obj is None) != (state[name] is None):
                raise ValueError(
                    f"saved server state has {name}={state[name] is not None}, "
                    f"but the config gives {obj is not None}: config changed?"
                )
            if obj is not None:
                obj.load_state_dict(state[name])

    def _connected_nodes(self, grid: Grid) -> list[int]:
        """Return the connected nodes, waiting until ``min_available_nodes`` are."""
        while len(nodes := list(grid.get_node_ids())) < self.min_available_nodes:
            log(
                INFO,
                "waiting for nodes: %d connected, %d needed",
                len(nodes),
                self.min_available_nodes,
            )
            time.sleep(1.0)
        return nodes

    def learn_node_order(self, grid: Grid, timeout: float) -> None:
        """Ask nodes not seen before for their ``partition-id`` (a ``query`` message).

        The answers order the nodes for Poisson sampling (see :mod:`.sampling`); a node that
        does not answer is ordered by its node id.
        """
        unknown = [n for n in self._connected_nodes(grid) if n not in self.node_order]
        if not unknown:
            return
        messages = [
            Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n)
            for n in unknown
        ]
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error() or not reply.content.metric_records:
                continue
            metrics = next(iter(reply.content.metric_records.values()))
            if "partition-id" in metrics:
                self.node_order[reply.metadata.src_node_id] = int(metrics["partition-id"])

    # ------------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Poisson-sample the cohort and send it the global arrays and this round's budgets."""
        self.current_arrays = arrays
        node_ids = self._connected_nodes(grid)
        self.population = len(node_ids)
        self.cohort = self.sampler.sample(node_ids, order=self.node_order)
        log(
            INFO,
            "configure_train: Poisson cohort of %d (q=%.4g, K=%d)",
            len(self.cohort),
            self.config.sampling_rate,
            self.population,
        )
        budgets = self.budgets()
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        config["num-rounds"] = self.config.num_rounds
        config["local-epochs"] = self.config.local_epochs
        config["round-seed"] = int(self.seed_rng.integers(2**31 - 1))
        if budgets is not None:
            config["clip-budgets"] = json.dumps(budgets)
            config["clip-groups"] = json.dumps(list(self.layout.names))
            config["clip-components"] = json.dumps(list(self.layout.components))
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, self.cohort, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, re-clip, aggregate, add noise once, and return the new global arrays."""
        if self.current_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        global_params = self.current_arrays.to_torch_state_dict()
        shapes = {k: tuple(v.shape) for k, v in global_params.items()}
        updates: list[ClientUpdate] = []
        failures: list[str] = []
        replied = set()
        for message in replies:
            replied.add(message.metadata.src_node_id)
            try:
                updates.append(
                    parse_train_reply(
                        message,
                        expected_shapes=shapes,
                        allow_partial=bool(getattr(self.rule, "accepts_partial", False)),
                    )
                )
            except ReplyRejected as err:
                failures.append(str(err))
        for node in sorted(set(self.cohort) - replied):
            failures.append(f"node {node}: no reply within {self.config.round_timeout:g} s")
        for reason in failures:
            log(WARNING, "round %d: dropped %s", server_round, reason)
        # a fixed summation order makes the float sum independent of reply arrival order
        updates.sort(key=lambda u: (u.metrics.get("partition-id", u.node_id), u.node_id))
        if len(updates) < self.config.min_clients:
            raise RoundFailed(
                f"round {server_round}: {len(updates)} valid replies from a cohort of "
                f"{len(self.cohort)} (K={self.population}), fewer than min_clients="
                f"{self.config.min_clients}"
            )
        report = RoundReport(
            round=server_round,
            cohort_size=len(self.cohort),
            population=self.population,
            num_replied=len(updates),
            num_failed=len(failures),
            failures=failures,
            train_loss=_mean(
                [u.metrics["train-loss"] for u in updates if "train-loss" in u.metrics]
            ),
        )
        budgets = self.budgets()
        if budgets is not None:
            self._client_statistics(updates, budgets, report)
            for update in updates:  # server-side enforcement of the budgets (contract 3)
                update.delta, _ = clip_update(update.delta, budgets, layout=self.layout)
        if self.config.private:
            n = self.sampler.expected_cohort_size(self.population)
        else:
            n = float(len(updates))
        aggregate = self.rule(updates, expected_cohort_size=n)
        if self.noise is not None:
            aggregate = self.noise.add(aggregate, expected_cohort_size=n)
            report.noise_std = noise_std(
                noise_multiplier=self.config.noise_multiplier,
                clip=self.config.clip,
                expected_cohort_size=n,
            )
            self.accountant.step()
        new_params = {}
        for name, value in global_params.items():
            if name in aggregate:
                value = (value.to(torch.float64) + aggregate[name].to(torch.float64)).to(
                    value.dtype
                )
            if not bool(torch.isfinite(value).all()):
                raise FloatingPointError(
                    f"round {server_round}: the update made parameter {name!r} non-finite; "
                    "the global model was not changed"
                )
            new_params[name] = value
        if self.ema is not None:
            self._update_ema(updates, aggregate, report)
        self.last_report = report
        metrics = MetricRecord({"num-replied": len(updates), "cohort-size": len(self.cohort)})
        if report.train_loss is not None:
            metrics["train-loss"] = report.train_loss
        if self.accountant is not None:
            metrics["epsilon"] = float(self.accountant.epsilon())
        return ArrayRecord(new_params), metrics

    # ------------------------------------------------------------------ helpers
    def _client_statistics(
        self, updates: list[ClientUpdate], budgets: float | dict[str, float], report: RoundReport
    ) -> None:
        """Average the pre-clip statistics the clients reported (telemetry, Fig. 3/5)."""
        groups, comps = list(self.layout.names), list(self.layout.components)

        def column(key: str, names: list[str]) -> dict[str, float]:
            rows = [u.metrics[key] for u in updates if isinstance(u.metrics.get(key), list)]
            rows = [r for r in rows if len(r) == len(names)]
            if not rows:
                return {}
            return dict(
                zip(names, np.asarray(rows, dtype=float).mean(axis=0).tolist(), strict=True)
            )

        report.group_norms = column("group-norms", groups)
        report.group_clip_rates = column("group-clipped", groups)
        report.component_norms = column("component-norms", comps)
        report.component_clip_rates = column("component-clipped", comps)
        report.joint_norm_mean = _mean(
            [u.metrics["joint-norm"] for u in updates if "joint-norm" in u.metrics]
        )
        ratios = [u.metrics["clip-ratio"] for u in updates if "clip-ratio" in u.metrics]
        report.mean_clip_ratio = _mean(ratios)
        report.clip_rate = _mean([float(r < 1.0) for r in ratios])
        if isinstance(budgets, dict):
            report.group_budgets = dict(budgets)
            report.component_budgets = dict(component_budgets(self.layout, budgets))
        else:
            report.component_budgets = {"all": float(budgets)} if comps == ["all"] else {}

    def _update_ema(
        self, updates: list[ClientUpdate], aggregate: dict[str, torch.Tensor], report: RoundReport
    ) -> None:
        if self.config.ema_signal == "raw":
            observed = report.group_norms
            if not observed:
                raise ValueError("ema_signal='raw' needs the clients' 'group-norms' metric")
        else:
            std = report.noise_std or 0.0
            observed = noisy_norm_signal(aggregate, self.layout, std=std)
        self.ema.update({k: float(v) for k, v in observed.items() if math.isfinite(float(v))})

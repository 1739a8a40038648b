"""Server strategy: Poisson sampling, server-side re-clipping, pluggable aggregation, noise.

:class:`DPFedAvg` subclasses Flower's :class:`flwr.serverapp.strategy.FedAvg` and overrides only
``configure_train`` and ``aggregate_train``; why not Flower's DP wrappers, and the order of a
round's steps, are in its notes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from logging import INFO

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from speechbrain_fl.fl.aggregate.global_update import apply_aggregate
from speechbrain_fl.fl.aggregate.round_report import (
    AggregateFailed,
    RoundReport,
    client_statistics,
)
from speechbrain_fl.fl.aggregate.rules import get_rule
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.dp.canaries import FederatedAudit
from speechbrain_fl.fl.dp.mechanism import privacy_mechanism
from speechbrain_fl.fl.npy_codec import decode_record, encode_record
from speechbrain_fl.fl.serverapp.node_order import (
    connected_nodes,
    enrol_nodes,
    query_partitions,
)
from speechbrain_fl.fl.serverapp.replies import BufferPool
from speechbrain_fl.fl.serverapp.strategy_privacy import PrivacyStateMixin
from speechbrain_fl.fl.serverapp.strategy_replies import ReplyCollectionMixin
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy import Layout

# RoundReport, its failures and partition_id_of are the strategy's vocabulary: importable here
__all__ = ["DPFedAvg"]


class DPFedAvg(PrivacyStateMixin, ReplyCollectionMixin, FedAvg):
    """FedAvg with Poisson sampling, per-group clipping, central Gaussian noise and accounting.

    Arguments
    ---------
    config : FLConfig
        Federated and privacy settings.
    layout : speechbrain_fl.privacy.Layout
        Trainable groups of the model (names, components, sizes).
    min_available_nodes : int
        Nodes to wait for before sampling.
    population_size : int, optional
        The number of partitions, the default of ``config.population_size`` (the declared K).
    partition_sizes : sequence of int, optional
        Examples per partition when the server knows them (simulation): bounds a reply's
        ``num-examples`` (:mod:`speechbrain_fl.fl.serverapp.replies`).
    depth_names : mapping of int to collection of str, optional
        For a model with exits: exit -> the tensors a client of that depth trains; a partial
        (layer-wise) reply must declare one of these exits and carry only tensors at or below it.

    Notes
    -----
    :class:`DPFedAvg` subclasses Flower's message-based :class:`flwr.serverapp.strategy.FedAvg` and
    overrides only ``configure_train`` and ``aggregate_train`` (federated evaluation is switched
    off with ``fraction_evaluate=0``; the server evaluates centrally, see
    :mod:`speechbrain_fl.fl.serverapp.main`). Why not wrap FedAvg with Flower's
    ``DifferentialPrivacyServerSideFixedClipping``: that wrapper clips the whole model with one
    norm, samples a fixed count, averages over the realised replies and accounts only without
    amplification, whereas the contracts here need per-group budgets (docs/design.md 2-3), Poisson
    sampling with a fixed denominator n = qK (contract 4) and an RDP accountant with subsampling
    (contract 5). The structure is the same as Flower's wrapper: keep the global arrays seen in
    ``configure_train``, clip every reply, aggregate, add noise once, return global + update.

    One round, for replies u_1..u_m of a cohort drawn with rate q from the declared population K
    (``population_size``, default the number of partitions; n = qK):

    1. take one reply per sampled node, reject faulty ones
    (:mod:`speechbrain_fl.fl.serverapp.replies`), each with a log line; 2. a non-private round with
    fewer than ``min_clients`` valid replies -> :class:`RoundFailed` (the server may re-sample it);
    a private round is *always* released, whoever replied (possibly nobody): every Poisson draw is
    one application of the sampled Gaussian mechanism, and a re-sampled round would release a
    cohort that is no longer Poisson(q); 3. re-clip: u_i <- clip(u_i, C_l) per group, so a client
    that skipped clipping cannot raise the sensitivity above C (contract 3); 4. aggregate with the
    rule (default DP rule sum_i u_i / n, McMahan et al. 2018, Alg. 1); 5. add N(0, (sigma C / n)^2
    I) once (contract 4) to every parameter, one accountant step (the round's standard normals are
    drawn in a worker thread while the clients train,
    :meth:`~speechbrain_fl.privacy.GaussianNoise.prepare`, the same draws bit for bit); 6. EMA
    budgets: update from ``noisy_norm_signal`` of the released aggregate (post-processing) or, with
    ``ema_signal="raw"``, from the clients' reported norms (outside the DP guarantee); 7. theta <-
    theta + update; a non-finite result raises instead of being applied.

    Audit (``audit_canaries: m`` > 0, private runs; :mod:`speechbrain_fl.fl.dp.canaries`): each
    inserted canary is drawn every round by the run's own Poisson sampler; a drawn one adds a
    re-clipped update at the clip bound to the sum of step 4, before the noise of step 5
    (calibrated to n = qK real clients, so the real clients' epsilon is unchanged).
    :meth:`DPFedAvg.audit_report` scores them.

    Randomness (docs/design.md "Privacy invariants"): a private run draws the cohort sampler's and
    the noise's seeds from the OS and keeps them in memory only; ``seed`` seeds the clients'
    training only. :meth:`DPFedAvg.state_dict` holds the accountant, the EMA budgets and the
    privacy settings, nothing from which past cohorts or noise could be derived; a resume with
    other privacy settings is refused (:meth:`DPFedAvg.load_state_dict`).

    Clients receive their budgets in the round's ConfigRecord as JSON (``clip-budgets``: a float
    for ``flat`` or ``{group: C_l}``), not the method and EMA state: clients then need no privacy
    state, cannot drift from the server's budgets, and a resumed server sends the same numbers.

    Where the parts of :class:`DPFedAvg` live: this module holds the class, its cohort drawing and
    ``configure_train``, and steps 4-7 of ``aggregate_train``; steps 1-3 (the replies) are
    :class:`speechbrain_fl.fl.serverapp.strategy_replies.ReplyCollectionMixin`'s; the budgets,
    epsilon, EMA update, audit report and resume state are
    :class:`speechbrain_fl.fl.serverapp.strategy_privacy.PrivacyStateMixin`'s.

    Example
    -------
    >>> from speechbrain_fl.privacy import Group, Layout
    >>> cfg = FLConfig(output_folder="out", sampling_rate=0.5, noise_multiplier=1.0, clip=1.0,
    ...                population_size=4)
    >>> strategy = DPFedAvg(config=cfg, layout=Layout([Group("w", "all", 3)]))
    >>> strategy.budgets(), strategy.expected_cohort_size()
    (1.0, 2.0)
    """

    def __init__(
        self,
        *,
        config: FLConfig,
        layout: Layout,
        min_available_nodes: int = 1,
        population_size: int | None = None,
        partition_sizes: Sequence[int] | None = None,
        depth_names: Mapping[int, Collection[str]] | None = None,
    ) -> None:
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
        self.population_size = config.population_size or population_size
        if config.private and self.population_size is None:
            raise ValueError(
                "a private run needs a declared population K (n = qK in the noise and the "
                "accountant): set population_size in the federated config, or give the "
                "ServerTask its num_partitions"
            )
        self.sampler, self.noise, self.accountant, self.ema = privacy_mechanism(config, layout)
        self.seed_rng = np.random.default_rng(None if config.seed is None else config.seed + 1)
        self._draws: dict[int, int] = {}
        self._population_warned: int | None = None
        self.partition_sizes = (
            None if partition_sizes is None else [int(n) for n in partition_sizes]
        )
        partial = bool(getattr(self.rule, "accepts_partial", False))
        self.depth_names = (
            {int(e): frozenset(names) for e, names in depth_names.items()}
            if depth_names and partial
            else None
        )
        self.require_depth = getattr(self.rule, "weighting", None) == "depth_aware"
        self.refused_nodes: dict[int, str] = {}
        self.current_arrays: ArrayRecord | None = None
        self.cohort: list[int] = []
        self.population = 0
        self.node_order: dict[int, int] = {}
        self.last_report: RoundReport | None = None
        self._round_figure: tuple[tuple[int, str], float] | None = None
        # the decoded replies' buffers, reused from round to round (replies.BufferPool)
        self._reply_pool = BufferPool()
        # the round's ConfigRecord entries that depend only on the layout, made once
        self._group_json = json.dumps(list(layout.names))
        self._component_json = json.dumps(list(layout.components))
        self.audit = (
            FederatedAudit(config, layout, self.sampler)
            if config.private and config.audit_canaries
            else None
        )
        self.init_adaptive()  # clip_quantile: the clips' state, the update's noise at sigma_Delta

    # ------------------------------------------------------------------ cohort
    def _next_draw(self, server_round: int) -> tuple[int, int]:
        """Key of the next cohort draw of ``server_round``; a private run draws once a round."""
        attempt = self._draws.get(server_round, 0)
        if attempt and self.config.private:
            raise RuntimeError(
                f"round {server_round} was already drawn: a private run releases every Poisson "
                "draw and is never re-sampled"
            )
        self._draws = {server_round: attempt + 1}
        return server_round, attempt

    def _connected_nodes(self, grid: Grid) -> list[int]:
        """Return the connected nodes, waiting until ``min_available_nodes`` are."""
        return connected_nodes(grid, self.min_available_nodes)

    def learn_node_order(self, grid: Grid, timeout: float) -> None:
        """Ask nodes not seen before for their ``partition-id`` (a ``query`` message).

        The answers order the nodes for Poisson sampling (see :mod:`speechbrain_fl.fl.dp.sampling`); a node that
        does not answer is ordered by its node id. A partition id already claimed by another
        node is refused: the later node (the higher node id among answers of one query) is
        never sampled and its replies are dropped, each time with a log line, so one data
        owner counts once in the population, the cohort and the accountant (docs/fl_engine.md
        "Identity in deployment").
        """
        known = self.node_order.keys() | self.refused_nodes.keys()
        unknown = [n for n in self._connected_nodes(grid) if n not in known]
        if not unknown:
            return
        enrol_nodes(
            query_partitions(grid, unknown, timeout=timeout),
            node_order=self.node_order,
            refused=self.refused_nodes,
            binding=self.config.node_partitions,
        )

    # ------------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Poisson-sample the cohort and send it the global arrays and this round's budgets."""
        self.current_arrays = arrays
        node_ids = [n for n in self._connected_nodes(grid) if n not in self.refused_nodes]
        if self.config.node_partitions is not None:  # only enrolled nodes are ever sampled
            node_ids = [n for n in node_ids if n in self.config.node_partitions]
        self.population = len(node_ids)
        self.check_population(self.population)
        draw = self._next_draw(server_round)
        self.cohort = self.sampler.sample(node_ids, order=self.node_order, draw=draw)
        log(
            INFO,
            "configure_train: Poisson cohort of %d (q=%.4g, %d connected, K=%s)",
            len(self.cohort),
            self.config.sampling_rate,
            self.population,
            self.population_size if self.population_size is not None else self.population,
        )
        budgets = self.budgets()
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        config["num-rounds"] = self.config.num_rounds
        config["local-epochs"] = self.config.local_epochs
        config["round-seed"] = int(self.seed_rng.integers(2**31 - 1))
        if budgets is not None:
            config["clip-budgets"] = json.dumps(budgets)
        if self.adaptive is not None:  # the pools' clips the clients compare their norms to
            config["clip-quantile-pools"] = self.adaptive_message()
        if budgets is not None or self.config.record_norms:
            # without budgets the clients measure their update's group norms, clip nothing
            config["clip-groups"] = self._group_json
            config["clip-components"] = self._component_json
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        messages = self._construct_messages(record, self.cohort, MessageType.TRAIN)
        if self.noise is not None:  # the round's normals drawn while the clients train
            self.noise.prepare([math.prod(a.shape) for a in arrays.values()], draw=server_round)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, re-clip, aggregate, add noise once, and return the new global arrays.

        Every per-reply check (format, claims, re-clipping) runs inside one guard: a bad reply
        is dropped with one log line naming the node and the reason, counted in
        ``RoundReport.num_dropped``, and the round goes on. In a non-private run an unusable
        aggregate (the rule raised, a non-finite value) raises :class:`AggregateFailed`.
        Steps 1-7 of the module docstring, one method each.
        """
        if self.current_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        global_params = decode_record(self.current_arrays)  # to_torch_state_dict(), cached header
        budgets = self.budgets()
        updates, report = self._collect_replies(server_round, replies, global_params, budgets)
        self._enforce_min_clients(report, updates)
        self.last_report = report
        if budgets is None and self.config.record_norms:
            client_statistics(updates, None, report, layout=self.layout)  # norms only
        if budgets is not None:
            # the round's budgets are recorded even when nobody replied (a private round is
            # released all the same): the privacy report's per-pool sigma_eff reads them
            client_statistics(updates, budgets, report, layout=self.layout)
        updates, aggregate = self._noisy_aggregate(updates, global_params, budgets, report)
        if self.adaptive is not None:  # the noisy counts of the replies' bits move the clips
            self.adapt_clip(self.central_bit_sums(updates), num_counted=len(updates), report=report)
        new_params, bad = apply_aggregate(global_params, aggregate)
        if bad is not None:
            reason = (
                f"the update made parameter {bad!r} non-finite; the global model was not changed"
            )
            if self.config.private:
                raise FloatingPointError(f"round {server_round}: {reason}")
            raise self._failed(report, reason)
        if self.ema is not None:
            self._update_ema(updates, aggregate, report)
        self.current_arrays = None  # one release per configured draw
        return encode_record(new_params), self._round_metrics(updates, report)

    def _noisy_aggregate(
        self,
        updates: list[ClientUpdate],
        global_params: Mapping[str, torch.Tensor],
        budgets: float | dict[str, float] | None,
        report: RoundReport,
    ) -> tuple[list[ClientUpdate], dict[str, torch.Tensor]]:
        """Steps 4-5: the rule's aggregate over n (qK private, m otherwise), noised once.

        Returns the updates summed (the canaries of an audited round included) and the
        aggregate; a private run's aggregate has every parameter, each with its noise.
        """
        private, server_round = self.config.private, report.round
        n = self.expected_cohort_size() if private else float(len(updates))
        if self.audit is not None:
            # canaries join the sum after the clients' statistics: they are not users
            updates = updates + self.audit.updates(server_round, global_params, budgets)
        try:
            aggregate = self.rule(updates, expected_cohort_size=n) if updates else {}
        except Exception as err:
            if private:
                raise
            raise self._failed(
                report, f"the aggregation rule raised {type(err).__name__}: {err}"
            ) from err
        if self.noise is not None:
            # every parameter is released with noise, also one no reply (or the rule) left out
            for name, value in global_params.items():
                if name not in aggregate:
                    aggregate[name] = torch.zeros(value.shape, dtype=torch.float64)
            report.noise_std = self.noise.std(n)
            aggregate = self.noise.add(aggregate, expected_cohort_size=n, draw=server_round)
            self.accountant.step()
        return updates, aggregate

    def _round_metrics(self, updates: list[ClientUpdate], report: RoundReport) -> MetricRecord:
        """The round's MetricRecord: replies, cohort, train loss, the running epsilon."""
        metrics = MetricRecord({"num-replied": len(updates), "cohort-size": len(self.cohort)})
        if report.train_loss is not None:
            metrics["train-loss"] = report.train_loss
        running = self.round_epsilon()
        if running is not None:  # e.g. "epsilon-rdp": the figure names its accountant
            metrics[f"epsilon-{running[1]}"] = running[0]
        return metrics

    def _failed(self, report: RoundReport, reason: str) -> AggregateFailed:
        """Record ``reason`` in ``report`` and return the :class:`AggregateFailed` to raise."""
        report.round_failed = reason
        return AggregateFailed(f"round {report.round}: {reason}")

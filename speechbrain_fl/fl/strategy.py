"""Server strategy: Poisson sampling, server-side re-clipping, pluggable aggregation, noise.

:class:`DPFedAvg` subclasses Flower's message-based :class:`flwr.serverapp.strategy.FedAvg` and
overrides only ``configure_train`` and ``aggregate_train`` (federated evaluation is switched off
with ``fraction_evaluate=0``; the server evaluates centrally, see :mod:`.server`). Why not wrap
FedAvg with Flower's ``DifferentialPrivacyServerSideFixedClipping``: that wrapper clips the whole
model with one norm, samples a fixed count, averages over the realised replies and accounts only
without amplification, whereas the contracts here need per-group budgets (docs/design.md 2-3),
Poisson sampling with a fixed denominator n = qK (contract 4) and an RDP accountant with
subsampling (contract 5). The structure is the same as Flower's wrapper: keep the global arrays
seen in ``configure_train``, clip every reply, aggregate, add noise once, return global + update.

One round, for replies u_1..u_m of a cohort drawn with rate q from the declared population K
(``population_size``, default the number of partitions; n = qK):

1. take one reply per sampled node, reject faulty ones (:mod:`.replies`), each with a log line;
2. a non-private round with fewer than ``min_clients`` valid replies -> :class:`RoundFailed` (the
   server may re-sample it); a private round is *always* released, whoever replied (possibly
   nobody): every Poisson draw is one application of the sampled Gaussian mechanism, and a
   re-sampled round would release a cohort that is no longer Poisson(q);
3. re-clip: u_i <- clip(u_i, C_l) per group, so a client that skipped clipping cannot raise the
   sensitivity above C (contract 3);
4. aggregate with the rule (default DP rule sum_i u_i / n, McMahan et al. 2018, Alg. 1);
5. add N(0, (sigma C / n)^2 I) once (contract 4) to every parameter, one accountant step (the
   round's standard normals are drawn in a worker thread while the clients train,
   :meth:`~speechbrain_fl.privacy.GaussianNoise.prepare`, the same draws bit for bit);
6. EMA budgets: update from ``noisy_norm_signal`` of the released aggregate (post-processing) or,
   with ``ema_signal="raw"``, from the clients' reported norms (outside the DP guarantee);
7. theta <- theta + update; a non-finite result raises instead of being applied.

Audit (``audit_canaries: m`` > 0, private runs; :mod:`.canaries`): each inserted canary is
drawn every round by the run's own Poisson sampler; a drawn one adds a re-clipped update at the
clip bound to the sum of step 4, before the noise of step 5 (calibrated to n = qK real clients,
so the real clients' epsilon is unchanged). :meth:`DPFedAvg.audit_report` scores them.

Randomness (docs/design.md "Privacy invariants"): a private run draws the cohort sampler's and the
noise's seeds from the OS and keeps them in memory only; ``seed`` seeds the clients' training
only. :meth:`DPFedAvg.state_dict` holds the accountant, the EMA budgets and the privacy settings,
nothing from which past cohorts or noise could be derived; a resume with other privacy settings
is refused (:meth:`DPFedAvg.load_state_dict`).

Clients receive their budgets in the round's ConfigRecord as JSON (``clip-budgets``: a float
for ``flat`` or ``{group: C_l}``), not the method and EMA state: clients then need no privacy
state, cannot drift from the server's budgets, and a resumed server sends the same numbers.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
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
    noisy_norm_signal,
)

from .aggregation import ClientUpdate, get_rule
from .canaries import FederatedAudit
from .config import FLConfig, ema_base_of
from .disclosure import privacy_disclosure
from .npy_codec import decode_record, encode_record
from .replies import BufferPool, ReplyLimits, ReplyRejected, parse_train_reply
from .sampling import PoissonSampler

__all__ = ["AggregateFailed", "DPFedAvg", "RoundFailed", "RoundReport", "partition_id_of"]

#: FLConfig fields a resumed run must not change (the privacy settings of its earlier rounds).
PRIVACY_KEYS = (
    "noise_multiplier",
    "clip",
    "delta",
    "sampling_rate",
    "accountant",
    "method",
    "alpha",
    "ema_beta",
    "ema_gamma",
    "ema_warmup_rounds",
    "ema_signal",
)


class RoundFailed(RuntimeError):
    """Fewer than ``min_clients`` valid replies in a non-private run; the round may be retried."""


class AggregateFailed(RoundFailed):
    """The aggregate of a non-private round is unusable (the rule raised, or a value non-finite).

    Retried like :class:`RoundFailed`; once the retries are spent the server records the round
    as failed, keeps the global model and goes on (:func:`speechbrain_fl.fl.server.run_server`).
    """


def partition_id_of(metrics: Any) -> int | None:
    """The integer ``partition-id`` of a query reply's metrics, or ``None`` when absent or bad.

    Example
    -------
    >>> partition_id_of({"partition-id": 2}), partition_id_of({"partition-id": [2]})
    (2, None)
    """
    value = metrics.get("partition-id") if hasattr(metrics, "get") else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not (math.isfinite(value) and float(value).is_integer() and value >= 0):
        return None
    return int(value)


def _layout_rows(layout: Layout) -> list[list[Any]]:
    return [[g.name, g.component, g.numel, list(g.parameter_names)] for g in layout]


def _layout_difference(old: list, new: list) -> str:
    if len(old) != len(new):
        return f"{len(old)} groups -> {len(new)} groups"
    for a, b in zip(old, new, strict=True):
        if list(a) != list(b):
            return f"group {list(a)} -> {list(b)} (name, component, numel, members)"
    return "same groups"


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
    connected: int | None = None
    ignored: list[str] = field(default_factory=list)
    num_dropped: int = 0
    round_failed: str | None = None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


#: Parameter dtypes whose update :func:`_updated` makes in one NumPy pass (float16 is left to
#: torch, whose float64 -> float16 cast goes through float32).
_NUMPY_PARAMS = (torch.float32, torch.float64)


def _updated(value: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``(value.to(float64) + update.to(float64)).to(value.dtype)``, the same two roundings.

    On CPU NumPy adds in float64 (``dtype=float64`` casts both inputs exactly) and rounds to
    the parameter's dtype in one pass each, without torch's two float64 temporaries.

    Example
    -------
    >>> _updated(torch.ones(2), torch.full((2,), 0.5, dtype=torch.float64)).tolist()
    [1.5, 1.5]
    """
    if (
        value.device.type == "cpu"
        and update.device.type == "cpu"
        and value.dtype in _NUMPY_PARAMS
        and update.dtype in (torch.float16, torch.float32, torch.float64)
    ):
        # an overflow gives inf silently, as in torch (the caller checks finiteness); asarray:
        # the sum of two 0-d arrays is a NumPy scalar
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.asarray(
                np.add(value.detach().numpy(), update.detach().numpy(), dtype=np.float64)
            )
            if value.dtype == torch.float32:
                total = total.astype(np.float32)
        return torch.from_numpy(total)
    return (value.to(torch.float64) + update.to(torch.float64)).to(value.dtype)


def _all_finite(value: torch.Tensor) -> bool:
    """``bool(torch.isfinite(value).all())``; NumPy's on CPU (~5 us for 65k float32 values on
    one CPU thread here, torch's ~190 us).

    Example
    -------
    >>> _all_finite(torch.ones(3)), _all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    if value.device.type == "cpu" and value.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(value.detach().numpy()).all())
    return bool(torch.isfinite(value).all())


class DPFedAvg(FedAvg):
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
        ``num-examples`` (:mod:`.reply_checks`).
    depth_names : mapping of int to collection of str, optional
        For a model with exits: exit -> the tensors a client of that depth trains; a partial
        (layer-wise) reply must declare one of these exits and carry only tensors at or below it.

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
        else:  # no privacy claim: the public seed gives reproducible cohorts
            sampler_seed = config.seed if config.sampler_seed is None else config.sampler_seed
        self.sampler = PoissonSampler(config.sampling_rate, seed=sampler_seed)
        self.seed_rng = np.random.default_rng(None if config.seed is None else config.seed + 1)
        self._draws: dict[int, int] = {}
        self._population_warned: int | None = None
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
        base = ema_base_of(config.method) if config.clip is not None else None
        if base is not None:
            self.ema = EMABudgetState(
                layout,
                base=base,
                beta=config.ema_beta,
                gamma=config.ema_gamma,
                warmup_rounds=config.ema_warmup_rounds,
                signal=config.ema_signal,
            )
            if config.ema_signal == "raw":
                log(
                    WARNING,
                    "ema_signal='raw': the EMA budgets use raw client norms, which is "
                    "OUTSIDE the differential-privacy guarantee (paper reproduction only)",
                )
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

    # ------------------------------------------------------------------ budgets, state
    def budgets(self) -> float | dict[str, float] | None:
        """Return this round's clip budgets (``None`` when clipping is off)."""
        if self.config.clip is None:
            return None
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
        and the final :class:`~.server.ServerResult` report it.
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

        See :func:`speechbrain_fl.fl.disclosure.privacy_disclosure`.
        """
        return privacy_disclosure(
            self.config, profile_rounds=profile_rounds, alpha_from_profile=alpha_from_profile
        )

    def privacy_settings(self) -> dict[str, Any]:
        """The settings a resumed run must keep: C, delta, q, sigma, method, layout, K."""
        settings = {key: getattr(self.config, key) for key in PRIVACY_KEYS}
        settings["aggregation"] = self.config.aggregation_rule_name
        settings["population_size"] = self.population_size
        settings["layout"] = _layout_rows(self.layout)
        return settings

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
        }

    def check_privacy_settings(self, saved: dict[str, Any] | None, *, source: str) -> None:
        """Raise ``ValueError`` naming the first privacy setting that differs from ``saved``."""
        if saved is None:
            raise ValueError(
                f"{source} records no privacy settings (written by an earlier version, which "
                "also stored the noise seed): it cannot be resumed safely; delete it to restart"
            )
        current = self.privacy_settings()
        for key, new in current.items():
            old = saved.get(key)
            if old == new:
                continue
            if key == "layout":
                raise ValueError(
                    f"{source}: resuming would change the layout ({_layout_difference(old, new)})"
                    "; the earlier rounds were clipped and accounted with the old one. Restore "
                    "it, or start a new run in another output_folder"
                )
            raise ValueError(
                f"{source}: resuming would change {key} from {old!r} to {new!r}; the earlier "
                "rounds were noised and accounted with the old value. Restore it, or start a "
                "new run in another output_folder"
            )

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
        for name in ("noise", "accountant", "ema"):
            obj = getattr(self, name)
            if (obj is None) != (state[name] is None):
                raise ValueError(
                    f"{source} has {name}={state[name] is not None}, "
                    f"but the config gives {obj is not None}: config changed?"
                )
            if obj is not None:
                obj.load_state_dict(state[name])

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
        polls = 0
        while len(nodes := list(grid.get_node_ids())) < self.min_available_nodes:
            if polls % 20 == 0:
                log(
                    INFO,
                    "waiting for nodes: %d connected, %d needed",
                    len(nodes),
                    self.min_available_nodes,
                )
            polls += 1
            time.sleep(0.1)
        return nodes

    def learn_node_order(self, grid: Grid, timeout: float) -> None:
        """Ask nodes not seen before for their ``partition-id`` (a ``query`` message).

        The answers order the nodes for Poisson sampling (see :mod:`.sampling`); a node that
        does not answer is ordered by its node id. A partition id already claimed by another
        node is refused: the later node (the higher node id among answers of one query) is
        never sampled and its replies are dropped, each time with a log line, so one data
        owner counts once in the population, the cohort and the accountant (docs/fl_engine.md
        "Identity in deployment").
        """
        unknown = [
            n
            for n in self._connected_nodes(grid)
            if n not in self.node_order and n not in self.refused_nodes
        ]
        if not unknown:
            return
        messages = [
            Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n)
            for n in unknown
        ]
        asked, answers = set(unknown), {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            node = reply.metadata.src_node_id
            if node not in asked or reply.has_error() or not reply.content.metric_records:
                continue
            asked.discard(node)  # one answer per node
            partition = partition_id_of(next(iter(reply.content.metric_records.values())))
            if partition is None:
                log(WARNING, "node %d: query reply without an integer partition-id", node)
            else:
                answers[node] = partition
        owner = {p: n for n, p in self.node_order.items()}
        binding = self.config.node_partitions
        for node in sorted(answers):
            partition = answers[node]
            reason = None
            if binding is not None and node not in binding:
                reason = "its node id is not in node_partitions (not an enrolled SuperNode)"
            elif binding is not None and binding[node] != partition:
                reason = (
                    f"it answered partition-id={partition}, but node_partitions binds it to "
                    f"partition {binding[node]}"
                )
            elif partition in owner:
                reason = f"partition-id={partition} is already claimed by node {owner[partition]}"
            if reason is not None:
                self.refused_nodes[node] = reason
                log(
                    WARNING,
                    "node %d: refused, %s; its replies are dropped (check the SuperNodes' "
                    "--node-config)",
                    node,
                    self.refused_nodes[node],
                )
                continue
            owner[partition] = node
            self.node_order[node] = partition

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
        if budgets is not None or self.config.record_norms:
            # without budgets the clients measure their update's group norms, clip nothing
            config["clip-groups"] = self._group_json
            config["clip-components"] = self._component_json
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        messages = self._construct_messages(record, self.cohort, MessageType.TRAIN)
        if self.noise is not None:  # the round's normals drawn while the clients train
            self.noise.prepare([math.prod(a.shape) for a in arrays.values()], draw=server_round)
        return messages

    def reply_limits(self, global_params: Mapping[str, torch.Tensor]) -> ReplyLimits:
        """What a reply's claims are checked against this round (:mod:`.reply_checks`)."""
        return ReplyLimits(
            depth_names=self.depth_names,
            require_depth=self.require_depth,
            partition_sizes=self.partition_sizes,
            max_num_examples=self.config.max_num_examples,
            max_update_norm=self.config.max_update_norm,
            dtypes={k: v.dtype for k, v in global_params.items()},
        )

    def _parse(self, message: Message, shapes, limits: ReplyLimits) -> ClientUpdate:
        """One reply -> a checked update (format, claims, partition), or :class:`ReplyRejected`."""
        node = message.metadata.src_node_id
        update = parse_train_reply(
            message,
            expected_shapes=shapes,
            allow_partial=bool(getattr(self.rule, "accepts_partial", False)),
            limits=limits,
            pool=self._reply_pool,
        )
        claimed = update.metrics.get("partition-id")
        known = self.node_order.get(node)
        if known is not None and claimed is not None and int(claimed) != known:
            raise ReplyRejected(
                f"node {node}: partition-id={claimed:g} differs from the partition-id={known} "
                "it answered to the server's query"
            )
        return update

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, re-clip, aggregate, add noise once, and return the new global arrays.

        Every per-reply check (format, claims, re-clipping) runs inside one guard: a bad reply
        is dropped with one log line naming the node and the reason, counted in
        ``RoundReport.num_dropped``, and the round goes on. In a non-private run an unusable
        aggregate (the rule raised, a non-finite value) raises :class:`AggregateFailed`.
        """
        if self.current_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        global_params = decode_record(self.current_arrays)  # to_torch_state_dict(), cached header
        shapes = {k: tuple(v.shape) for k, v in global_params.items()}
        limits = self.reply_limits(global_params)
        budgets = self.budgets()
        updates: list[ClientUpdate] = []
        failures: list[str] = []
        ignored: list[str] = []
        sampled, replied = set(self.cohort), set()
        dropped = 0
        for message in replies:
            node = message.metadata.src_node_id
            if node in self.refused_nodes:
                ignored.append(f"node {node}: refused ({self.refused_nodes[node]}), reply dropped")
                continue
            if node not in sampled:
                ignored.append(f"node {node}: not sampled this round, reply ignored")
                continue
            if node in replied:
                ignored.append(f"node {node}: a second reply this round, ignored")
                continue
            replied.add(node)
            try:
                update = self._parse(message, shapes, limits)
                if budgets is not None:  # server-side enforcement of the budgets (contract 3)
                    update.delta, _ = clip_update(
                        update.delta, budgets, layout=self.layout, inplace=True
                    )
                updates.append(update)
            except ReplyRejected as err:
                failures.append(str(err))
                dropped += 1
            except Exception as err:  # defence in depth: no reply may crash the round
                failures.append(f"node {node}: unreadable reply ({type(err).__name__}: {err})")
                dropped += 1
        for node in sorted(sampled - replied):
            failures.append(f"node {node}: no reply within {self.config.round_timeout:g} s")
        for reason in failures + ignored:
            log(WARNING, "round %d: dropped %s", server_round, reason)
        # a fixed summation order makes the float sum independent of reply arrival order
        updates.sort(key=lambda u: (u.metrics.get("partition-id", u.node_id), u.node_id))
        private = self.config.private
        report = RoundReport(
            round=server_round,
            cohort_size=len(self.cohort),
            population=self.population_size if private else self.population,
            num_replied=len(updates),
            num_failed=len(failures),
            failures=failures,
            train_loss=_mean(
                [u.metrics["train-loss"] for u in updates if "train-loss" in u.metrics]
            ),
            connected=self.population,
            ignored=ignored,
            num_dropped=dropped,
        )
        if len(updates) < self.config.min_clients:
            summary = (
                f"round {server_round}: {len(updates)} valid replies from a cohort of "
                f"{len(self.cohort)} ({self.population} connected), fewer than min_clients="
                f"{self.config.min_clients}"
            )
            if not private:
                report.round_failed = summary
                self.last_report = report
                raise RoundFailed(summary)
            log(
                WARNING,
                "%s; released anyway (noise and an accountant step): a private run releases "
                "every Poisson draw",
                summary,
            )
        self.last_report = report
        if budgets is None and self.config.record_norms:
            self._client_statistics(updates, None, report)  # norms only: nothing to clip
        if budgets is not None:
            # the round's budgets are recorded even when nobody replied (a private round is
            # released all the same): the privacy report's per-pool sigma_eff reads them
            self._client_statistics(updates, budgets, report)
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
        new_params = {}
        for name, value in global_params.items():
            if name in aggregate:
                value = _updated(value, aggregate[name])
            if not _all_finite(value):
                reason = (
                    f"the update made parameter {name!r} non-finite; the global model was not "
                    "changed"
                )
                if private:
                    raise FloatingPointError(f"round {server_round}: {reason}")
                raise self._failed(report, reason)
            new_params[name] = value
        if self.ema is not None:
            self._update_ema(updates, aggregate, report)
        metrics = MetricRecord({"num-replied": len(updates), "cohort-size": len(self.cohort)})
        self.current_arrays = None  # one release per configured draw
        if report.train_loss is not None:
            metrics["train-loss"] = report.train_loss
        running = self.round_epsilon()
        if running is not None:  # e.g. "epsilon-rdp": the figure names its accountant
            metrics[f"epsilon-{running[1]}"] = running[0]
        return encode_record(new_params), metrics  # ArrayRecord(new_params), byte for byte

    # ------------------------------------------------------------------ audit
    def audit_report(self, params: Mapping[str, torch.Tensor], *, confidence: float = 0.95):
        """The canary audit of the rounds run (:meth:`.canaries.FederatedAudit.report`).

        ``None`` without ``audit_canaries`` or before any audited round.
        """
        if self.audit is None:
            return None
        return self.audit.report(
            params, expected_cohort_size=self.expected_cohort_size(), confidence=confidence
        )

    def _failed(self, report: RoundReport, reason: str) -> AggregateFailed:
        """Record ``reason`` in ``report`` and return the :class:`AggregateFailed` to raise."""
        report.round_failed = reason
        return AggregateFailed(f"round {report.round}: {reason}")

    # ------------------------------------------------------------------ helpers
    def _client_statistics(
        self,
        updates: list[ClientUpdate],
        budgets: float | dict[str, float] | None,
        report: RoundReport,
    ) -> None:
        """Average the pre-clip statistics the clients reported (telemetry, Fig. 2/3/5)."""
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
        elif budgets is not None:
            report.component_budgets = {"all": float(budgets)} if comps == ["all"] else {}

    def _update_ema(
        self, updates: list[ClientUpdate], aggregate: dict[str, torch.Tensor], report: RoundReport
    ) -> None:
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

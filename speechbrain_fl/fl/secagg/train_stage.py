"""The train stage under secure aggregation: Flower's SecAgg+ between the clients and the noise.

With ``secure_aggregation: secaggplus`` the ServerApp learns only the sum of the cohort's
clipped, integer-encoded updates, then adds the noise after unmasking. One round is
:func:`secure_train_round` (its steps in its notes); :func:`secure_aggregation_mod` is the
ClientApp's side.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

from speechbrain_fl.fl.aggregate.global_update import apply_aggregate
from speechbrain_fl.fl.aggregate.layerwise import DEPTH_METRIC
from speechbrain_fl.fl.aggregate.round_report import (
    RoundFailed,
    RoundReport,
    client_statistics,
    cohort_report,
)
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.npy_codec import decode_record, encode_record
from speechbrain_fl.fl.secagg.layerwise import layerwise_average, layerwise_vector, weight_scale
from speechbrain_fl.fl.settings.secagg import REVEALED_METRICS, secure_weighting
from speechbrain_fl.privacy.secure_encoding import (
    MODULUS_BITS,
    quantization_range,
    shrunk_budgets,
)

__all__ = [
    "BIT_SCALE",
    "bit_sums",
    "bit_vector",
    "release_sum",
    "run_secaggplus",
    "secure_aggregation_mod",
    "secure_train_round",
]


# ---------------------------------------------------------------------------- client side
def secure_aggregation_mod(msg: Message, ctxt: Context, call_next: Callable) -> Message:
    """Flower's ``secaggplus_mod`` for train messages of a SecAgg+ round; others pass through.

    A train message carries SecAgg+'s ConfigRecord (``secaggplus``) only when the server runs
    the protocol, so the ClientApp installs this mod always and trains as usual otherwise.
    """
    if (
        msg.metadata.message_type != MessageType.TRAIN
        or RECORD_KEY_CONFIGS not in msg.content.config_records
    ):
        return call_next(msg, ctxt)
    return secaggplus_mod(msg, ctxt, _as_fitres(call_next))


def _as_fitres(call_next: Callable) -> Callable:
    """The train handler with its reply in the ``fitres.*`` form ``secaggplus_mod`` reads.

    The clipped update goes as float64 arrays in the order of the global tensors (the server
    maps the unmasked sum back by that order), with weight 1 (``num_examples``: the DP mean
    is sum / n, every client counts once) and only :data:`REVEALED_METRICS` beside it.
    """

    def handler(msg: Message, ctxt: Context) -> Message:
        reply = call_next(msg, ctxt)
        if reply.has_error():
            raise RuntimeError(f"training failed: {reply.error.reason}")
        config = msg.content["config"]
        shapes = {n: tuple(a.shape) for n, a in msg.content["arrays"].items()}
        delta = decode_record(reply.content["arrays"])
        metrics = reply.content["metrics"]
        if "secagg-weighting" in config:  # a layer-wise rule: weighted sums and weights
            arrays = layerwise_vector(
                delta,
                shapes=shapes,
                metrics=metrics,
                weighting=str(config["secagg-weighting"]),
                scale=float(config["secagg-weight-scale"]),
                box=float(config["secagg-box"]),
            )
        elif set(delta) != set(shapes):
            raise ValueError(
                "secure aggregation with the uniform rule sums whole updates: the reply must "
                f"carry every global tensor (missing {sorted(set(shapes) - set(delta))[:5]})"
            )
        else:
            arrays = [delta[n].detach().to(torch.float64).numpy() for n in shapes]
            if BIT_SCALE in config:  # adaptive clipping: the bits join the secure sum
                arrays.append(bit_vector(metrics["clip-bits"], scale=float(config[BIT_SCALE])))
        revealed = {k: metrics[k] for k in REVEALED_METRICS if k in metrics}
        fitres = FitRes(
            status=Status(Code.OK, ""),
            parameters=ndarrays_to_parameters(arrays),
            num_examples=1,
            metrics=revealed,
        )
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    return handler


#: The round's config entry with the scale c of the bits in the secure sum (adaptive clipping).
BIT_SCALE = "secagg-bit-scale"


def bit_vector(bits: list[float], *, scale: float) -> np.ndarray:
    """The client's bits as the last vector of its secure sum: ``b_p c`` with c the box.

    Each entry is 0 or c, inside SecAgg+'s box [-c, c], so the quantiser never cuts it; the
    server divides the unmasked sum by c and rounds (:func:`bit_sums`).

    Example
    -------
    >>> bit_vector([1.0, 0.0], scale=0.5)
    array([0.5, 0. ])
    """
    return np.asarray(bits, dtype=np.float64) * float(scale)


def bit_sums(mean: np.ndarray, *, survivors: int, scale: float) -> list[float]:
    """The pools' bit sums from SecAgg+'s mean of :func:`bit_vector` over ``survivors``.

    ``round(m mean / c)``: stochastic rounding moves each client's entry by less than one step
    2c / T, so the decoded count is off by less than 2m / T (< 1/2 for every cohort
    :func:`~speechbrain_fl.privacy.secure_encoding.quantization_range` allows) and rounding
    gives the exact count, clamped to [0, m].

    Example
    -------
    >>> bit_sums(np.array([0.25, 0.5 - 1e-7]), survivors=4, scale=0.5)
    [2.0, 4.0]
    """
    counts = np.rint(np.asarray(mean, dtype=np.float64) * survivors / float(scale))
    return [float(min(max(c, 0.0), survivors)) for c in counts]


# ---------------------------------------------------------------------------- server side
class _Cohort(Strategy):
    """The legacy strategy SecAgg+'s stages call: hands over the cohort, keeps the aggregate."""

    def __init__(self, nodes: list[int], grid: Any) -> None:
        self.proxies = [GridClientProxy(node, grid, 0) for node in nodes]
        self.mean: list[np.ndarray] | None = None
        self.revealed: dict[int, dict[str, Any]] = {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(proxy, FitIns(Parameters([], ""), {})) for proxy in self.proxies]

    def aggregate_fit(self, server_round, results, failures):
        if results:  # every result carries the same unmasked mean over the survivors
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
            self.revealed = {proxy.node_id: dict(res.metrics) for proxy, res in results}
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def _workflow(config, *, box: float, target_range: int) -> SecAggPlusWorkflow:
    return SecAggPlusWorkflow(
        num_shares=config.secagg_num_shares,
        reconstruction_threshold=config.secagg_reconstruction_threshold,
        max_weight=1.0,
        clipping_range=float(box),
        quantization_range=int(target_range),
        modulus_range=2**MODULUS_BITS,
        timeout=config.round_timeout,
    )


def run_secaggplus(
    grid: Any,
    contents: Mapping[int, RecordDict],
    *,
    server_round: int,
    workflow: SecAggPlusWorkflow,
) -> tuple[list[np.ndarray] | None, dict[int, dict[str, Any]]]:
    """The four SecAgg+ stages over ``grid``: the mean over the survivors and their metrics.

    ``contents`` maps each sampled node to its train content; ``(None, {})`` when the
    protocol halted (too few live neighbours at a stage).
    """
    cohort = _Cohort(list(contents), grid)
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=cohort)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: server_round}
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    state = WorkflowState()
    if not workflow.setup_stage(grid, context, state):
        return None, {}
    # this engine's train content (global tensors, budgets, seed) in place of the FitIns;
    # one RecordDict per node: the stage adds each node's own key shares to it
    state.nid_to_fitins = {n: RecordDict(dict(c.items())) for n, c in contents.items()}
    for stage in (
        workflow.share_keys_stage,
        workflow.collect_masked_vectors_stage,
        workflow.unmask_stage,
    ):
        if not stage(grid, context, state):
            return None, {}
    return cohort.mean, cohort.revealed


def _round_contents(messages, strategy, target_range: int) -> tuple[dict, float, str | None]:
    """Each sampled node's train content for SecAgg+, the encoding's box and the weighting.

    With a clip the budgets are replaced by the shrunk ones and the box is their largest;
    without one the box is ``secagg_clipping_range``. A layer-wise rule adds its weighting,
    the server's bound on a client's weight and the box (:mod:`speechbrain_fl.fl.secagg.layerwise`).
    """
    cfg, budgets = strategy.config, strategy.budgets()
    extra: dict[str, Any] = {}
    if budgets is not None:
        shrunk, box = shrunk_budgets(budgets, layout=strategy.layout, target_range=target_range)
        extra["clip-budgets"] = json.dumps(shrunk)
    else:
        box = float(cfg.secagg_clipping_range)
    if strategy.adaptive is not None:
        extra[BIT_SCALE] = box
    weighting = secure_weighting(cfg.aggregation)
    if weighting is not None:
        extra.update({"secagg-weighting": weighting, "secagg-box": box,
                      "secagg-weight-scale": weight_scale(strategy, weighting)})  # fmt: skip
    contents = {}
    for message in messages:
        content = RecordDict(dict(message.content.items()))
        config = ConfigRecord(dict(content[strategy.configrecord_key]))
        config.update(extra)
        content[strategy.configrecord_key] = config
        contents[message.metadata.dst_node_id] = content
    return contents, box, weighting


def secure_train_round(grid: Any, strategy: Any, server_round: int, arrays: ArrayRecord):
    """One round's training under SecAgg+: sample, securely sum, then the run's mechanism.

    Arguments
    ---------
    grid : flwr.serverapp.Grid
        The ServerApp's Grid.
    strategy : speechbrain_fl.fl.serverapp.strategy.DPFedAvg
        The run's strategy (sampler, budgets, noise, accountant, EMA).
    server_round : int
        The round.
    arrays : flwr.app.ArrayRecord
        The global trainable tensors.

    Returns
    -------
    flwr.app.ArrayRecord
        The new global tensors (theta + (sum / n + noise)).

    Notes
    -----
    With ``secure_aggregation: secaggplus`` the ServerApp learns only the sum of the cohort's
    clipped updates. One round (:func:`secure_train_round`):

    1. the strategy Poisson-samples the cohort and builds its train messages as in every run
    (:meth:`speechbrain_fl.fl.serverapp.strategy.DPFedAvg.configure_train`); the round's clip
    budgets C_l in them are replaced by the shrunk budgets C_l' of
    :func:`speechbrain_fl.privacy.secure_encoding.shrunk_budgets`, so that the rounding of the
    encoding cannot push a client past C_l (without a clip: the box ``secagg_clipping_range``); a
    layer-wise rule adds its weighting (:mod:`speechbrain_fl.fl.secagg.layerwise`); 2. Flower's
    ``SecAggPlusWorkflow`` runs its four stages (setup, share keys, collect masked vectors, unmask)
    over the Grid; in the third the clients train, clip to C_l' (every clip method: the client code
    is unchanged), and Flower's ``secaggplus_mod`` encodes the update into Z_{2^32} and masks it
    (:func:`secure_aggregation_mod` puts the reply in the form the mod reads); the server sums the
    masked vectors and removes the masks with the shares of the surviving clients, dropped clients
    included up to the threshold; 3. the decoded sum goes through the run's mechanism: sum / n with
    n = qK, the Gaussian noise N(0, (sigma C / n)^2) added once by the server after unmasking, one
    accountant step, the EMA budgets from the noisy aggregate; the accountant is the central run's.
    Under adaptive clipping (``clip_quantile``) each client appends its pool bits to the vector it
    masks (:func:`bit_vector`), so the server learns only their sum (:func:`bit_sums`), noises it
    and moves the clips (:meth:`~speechbrain_fl.fl.serverapp.strategy_privacy.PrivacyStateMixin.adapt_clip`).

    Why the workflow's stages and not ``SecAggPlusWorkflow.__call__``: the workflow expects a
    ``LegacyContext`` whose (legacy) strategy samples the cohort and builds ``FitIns`` messages,
    whereas this engine samples with its own Poisson sampler and sends its own train content
    (global tensors, budgets, round seed). :func:`secure_train_round` calls the workflow's four
    public stage methods in ``__call__``'s order with a legacy strategy that only hands the sampled
    cohort over and receives the unmasked aggregate (:class:`_Cohort`), and gives each client this
    engine's train content in place of the converted ``FitIns`` after the setup stage. The
    cryptography, the quantisation and the unmasking are Flower's, unchanged.

    What the server receives from a client: its two public keys, its encrypted key shares (for
    other clients), its masked vector, its shares for unmasking, and in plaintext only the metrics
    of :data:`REVEALED_METRICS` (its partition id, and the count of audio files it could not
    decode). A partition id that differs from the one the node answered to the server's query is
    logged; the reply cannot be dropped (it is already in the sum), the node is refused from the
    next round on. Its pre-clip norms, clip indicators and train loss are not sent: the round's
    norm and clip-rate columns are empty and its ``train_loss`` is ``None``.

    A cohort of fewer than two clients cannot be summed securely (the sum would be the update): its
    replies are not requested and the round is released with the noise alone (a private run
    releases every Poisson draw), as is a round the protocol halted (too few live neighbours).
    """
    config = strategy.config
    strategy.learn_node_order(grid, timeout=config.round_timeout)
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    mean, revealed, encoding = None, {}, None
    if len(messages) >= 2:
        target_range = quantization_range(len(messages))
        contents, box, weighting = _round_contents(messages, strategy, target_range)
        workflow = _workflow(config, box=box, target_range=target_range)
        mean, revealed = run_secaggplus(
            grid, contents, server_round=server_round, workflow=workflow
        )
        encoding = (box, weighting)
    elif messages:
        log(
            WARNING,
            "round %d: a cohort of one cannot be summed securely; its update is not requested%s",
            server_round,
            " and the round is released with the noise alone" if config.private else "",
        )
    return release_sum(strategy, server_round, mean=mean, revealed=revealed, encoding=encoding)


def _report(strategy: Any, server_round: int, revealed: Mapping[int, Mapping]) -> RoundReport:
    """The round's report from what the server learns: who survived, and their counts."""
    survivors = set(revealed)
    failures = [
        f"node {n}: no masked vector (dropped, or the protocol halted)"
        for n in sorted(set(strategy.cohort) - survivors)
    ]
    for reason in failures:
        log(WARNING, "round %d: dropped %s", server_round, reason)
    for node, metrics in revealed.items():
        claimed, known = metrics.get("partition-id"), strategy.node_order.get(node)
        if claimed is not None and known is not None and int(claimed) != known:
            reason = f"partition-id={claimed:g} differs from the partition-id={known} it answered"
            log(WARNING, "round %d: node %d: %s; refused from now on", server_round, node, reason)
            strategy.refused_nodes[node] = reason
    counted = [ClientUpdate(node, {}, dict(metrics)) for node, metrics in revealed.items()]
    return cohort_report(strategy, server_round, counted, failures)


def release_sum(
    strategy: Any,
    server_round: int,
    *,
    mean: list[np.ndarray] | None,
    revealed: Mapping[int, Mapping[str, Any]],
    encoding: tuple[float, str | None] | None = None,
) -> ArrayRecord:
    """Steps 2 and 4-7 of :mod:`speechbrain_fl.fl.serverapp.strategy` on the unmasked sum (no per-reply step exists).

    ``mean`` is SecAgg+'s mean over the m survivors, in the order of the global tensors; the
    sum is m times it. A private run divides the sum by n = qK and adds the noise; a
    non-private one takes the mean, or with a layer-wise rule (``encoding``: the box and the
    weighting) the per-tensor weighted mean of :func:`speechbrain_fl.fl.secagg.layerwise.layerwise_average`.
    The run's rule then gets that one aggregate as a single update (a rule that wraps it, such
    as server momentum, applies as in a plain run).
    """
    cfg = strategy.config
    global_params = decode_record(strategy.current_arrays)
    budgets = strategy.budgets()
    report = _report(strategy, server_round, revealed)
    strategy.last_report = report
    m = len(revealed) if mean is not None else 0
    if m < cfg.min_clients:
        summary = (
            f"round {server_round}: {m} securely summed updates from a cohort of "
            f"{len(strategy.cohort)}, fewer than min_clients={cfg.min_clients}"
        )
        if not cfg.private:
            report.round_failed = summary
            raise RoundFailed(summary)
        log(WARNING, "%s; released anyway (noise and an accountant step)", summary)
    client_statistics([], budgets, report, layout=strategy.layout)  # the round's budgets
    counts = [0.0] * (0 if strategy.adaptive is None else len(strategy.adaptive.pools))
    if m and strategy.adaptive is not None:  # the bits' sum: the secure sum's last vector
        counts = bit_sums(mean[-1], survivors=m, scale=encoding[0])
        mean = mean[:-1]
    updates = []
    if m and encoding is not None and encoding[1] is not None:
        delta = layerwise_average(mean, names=list(global_params), survivors=m, box=encoding[0])
        updates = [ClientUpdate(-1, delta, {"num-examples": 1.0, DEPTH_METRIC: 1})]
    elif m:
        scale = float(m) if cfg.private else 1.0  # the rule divides by n (private) or by 1
        delta = {
            name: torch.from_numpy(np.asarray(value, dtype=np.float64) * scale)
            for name, value in zip(global_params, mean, strict=True)
        }
        updates = [ClientUpdate(-1, delta, {})]
    updates, aggregate = strategy._noisy_aggregate(updates, global_params, budgets, report)
    if strategy.adaptive is not None:  # nobody summed: the noisy count of no bits is released
        strategy.adapt_clip(counts, num_counted=m, report=report)
    new_params, bad = apply_aggregate(global_params, aggregate)
    if bad is not None:
        reason = f"the update made parameter {bad!r} non-finite; the global model was not changed"
        if cfg.private:
            raise FloatingPointError(f"round {server_round}: {reason}")
        raise strategy._failed(report, reason)
    if strategy.ema is not None:
        strategy._update_ema(updates, aggregate, report)
    strategy.current_arrays = None
    log(INFO, "round %d: securely summed %d of %d updates", server_round, m, len(strategy.cohort))
    return encode_record(new_params)

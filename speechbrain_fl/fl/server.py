"""ServerApp factory and the round loop (training, central evaluation, telemetry, resume).

The recipe supplies ``build_server(context) -> ServerTask``: the Brain holding the starting
global model (built without a checkpointer, like the client's), the :class:`FLConfig`, the
privacy layout and the validation data or an evaluation function. Only the ``requires_grad``
parameters of ``brain.modules`` are federated; frozen weights never cross the wire.

Decision: the loop is written here instead of calling ``Strategy.start`` because ``start`` always
begins at round 1 and offers no hook to checkpoint after a round, to retry a round that got too
few replies, or to stop before a round that would exceed ``max_epsilon``. It calls the strategy
exactly as ``start`` does (``configure_train`` -> ``grid.send_and_receive`` ->
``aggregate_train``), so any :class:`flwr.serverapp.strategy.Strategy` hook behaviour is kept.

Per round: refuse to start if the run's accountant says it would exceed ``max_epsilon`` (the
last round within it is found once,
:meth:`~speechbrain_fl.privacy.PrivacyAccountant.max_rounds`); train (a non-private run
retries up to ``max_retries`` times on :class:`~.strategy.RoundFailed`, then records the round
as failed, keeps the global model and goes on: no reply can end a run; it stops only when
fewer nodes are connected than ``min_clients``; a private run releases every draw and never
retries);
evaluate every ``eval_every`` rounds and at the last round (round 0 is always evaluated; the
server's Brain is given the global model for an evaluation and at the end of the run, not in
the rounds between);
commit the state atomically (:mod:`.state`: the accountant step, the new model, the round's
pending outputs), then evaluate, append to ``rounds.csv``/``group_norms.csv`` and
``train_log.txt`` and log a progress line: nothing derived from a round's (noisy) aggregate is
written before the round is committed. The round lines go through the task's ``train_logger``
(the recipe YAML's, as in any SpeechBrain recipe; default SpeechBrain's ``FileTrainLogger`` on
``<output_folder>/train_log.txt``): ``stats_meta={"round": r, "epsilon_rdp": e}`` (the
running figure, keyed by its accountant, FLConfig ``round_accountant``), ``train_stats=
{"loss": ...}``, ``valid_stats`` = the evaluation's metrics (e.g. ``WER``), so a
``TensorboardLogger`` shows rounds, losses, metrics and epsilon (a logger other than a
``FileTrainLogger`` gets the numeric meta values only: no ``"-"`` for a run without epsilon). A resume whose privacy settings (C, delta, q, sigma, clip
method and its settings, layout, declared population) differ from the saved ones is refused
with an error naming the key, both values and the state file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import speechbrain as sb
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from speechbrain.utils.train_logger import FileTrainLogger, TrainLogger

from speechbrain_fl.privacy import Group, Layout
from speechbrain_fl.privacy.accounting import privacy_report
from speechbrain_fl.privacy.audit import plot_audit_cosines
from speechbrain_fl.utils.atomic import sweep_stale_temporaries
from speechbrain_fl.utils.run_lock import hold_run_lock

from .config import FLConfig
from .config_checks import check_delta_population
from .npy_codec import decode_record
from .params import load_trainable, params_fingerprint, trainable_parameters, trainable_state
from .state import STATE_FILE, atomic_torch_save, capture_rng_states, load_state, restore_rng_states
from .strategy import AggregateFailed, DPFedAvg, RoundFailed, RoundReport
from .telemetry import RoundsTelemetry, progress_line, train_log_rounds, truncate_train_log

__all__ = ["ServerResult", "ServerTask", "make_server_app", "run_server"]


@dataclass
class ServerTask:
    """The server side of a recipe.

    Arguments
    ---------
    brain : speechbrain.Brain
        Holds the starting global model; used for central evaluation.
    config : FLConfig
        Federated and privacy settings.
    layout : speechbrain_fl.privacy.Layout, optional
        Groups/components; default: every trainable tensor its own group in component ``all``.
    valid_set : Dataset, optional
        Central validation data for the default evaluation (``valid_loss``).
    valid_loader_kwargs : dict
        Passed to ``brain.evaluate``.
    evaluate : callable, optional
        ``evaluate(brain) -> {metric: value}``; replaces the default evaluation.
    min_available_nodes : int
        Nodes to wait for before the first sampling (deployment).
    num_partitions : int, optional
        The number of client partitions: the declared population K of a private run when the
        config has no ``population_size``.
    partition_sizes : sequence of int, optional
        Examples in each partition, when the server knows them (simulation): a reply's
        ``num-examples`` must not exceed its partition's (:mod:`.reply_checks`). In deployment
        set the FLConfig key ``max_num_examples`` instead.
    depth_names : mapping of int to collection of str, optional
        Exit depth -> the tensors a client of that depth trains, for layer-wise (partial)
        replies; default: read from a module of ``brain.modules`` that has ``exits`` and
        ``trained_parameter_names(depth, prefix=...)`` (the multi-exit wav2vec 2.0).
    train_logger : speechbrain.utils.train_logger.TrainLogger, optional
        Where the round lines go (the recipe YAML's ``train_logger``); default a
        ``FileTrainLogger`` on ``<output_folder>/train_log.txt``.
    """

    brain: sb.Brain
    config: FLConfig
    layout: Layout | None = None
    valid_set: Any = None
    valid_loader_kwargs: dict[str, Any] = field(default_factory=dict)
    evaluate: Callable[[sb.Brain], dict[str, float]] | None = None
    min_available_nodes: int = 1
    num_partitions: int | None = None
    partition_sizes: Sequence[int] | None = None
    depth_names: Mapping[int, Collection[str]] | None = None
    train_logger: TrainLogger | None = None

    def __post_init__(self) -> None:
        if getattr(self.brain, "checkpointer", None) is not None:
            raise ValueError(
                "ServerTask.brain has a checkpointer: Brain.evaluate would recover it over the "
                "global parameters; build the server Brain with checkpointer=None (the engine "
                "saves its own state)"
            )


@dataclass
class ServerResult:
    """Final state of a run.

    Arguments
    ---------
    params : dict of str to Tensor
        The global trainable tensors after the last round.
    epsilon : float, optional
        Joint epsilon spent (``None`` for a run without noise).
    last_round : int
        Last finished round.
    stopped_early : bool
        The run stopped before ``num_rounds`` (``max_epsilon``).
    round_seconds : list of float
        Wall time of each round run by this process.
    round_budgets : list of dict
        Per trained round (1, 2, ...), the clip budget of each component label
        (``RoundReport.component_budgets``; ``{}`` for a flat budget over several components).
    reports : list of RoundReport
        The rounds run by this process (norms, clip rates, budgets).
    privacy : dict, optional
        :func:`speechbrain_fl.privacy.accounting.privacy_report` of the run (``None`` without
        noise).
    """

    params: dict[str, torch.Tensor]
    epsilon: float | None
    last_round: int
    stopped_early: bool = False
    round_seconds: list[float] = field(default_factory=list)
    round_budgets: list[dict[str, float]] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)
    privacy: dict[str, Any] | None = None


def default_layout(brain: sb.Brain) -> Layout:
    """One group per trainable tensor, component ``all``."""
    return Layout(
        [Group(n, "all", p.numel()) for n, p in trainable_parameters(brain.modules).items()]
    )


def model_depth_names(brain: sb.Brain) -> dict[int, set[str]] | None:
    """Exit -> names of the tensors a client of that depth trains, from a multi-exit module.

    A module of ``brain.modules`` with ``exits`` and ``trained_parameter_names(depth, prefix)``
    declares them (the names carry the module's key as prefix, like the federated tensors).
    """
    modules = getattr(brain, "modules", None)
    if modules is None or not hasattr(modules, "items"):
        return None
    for key, module in modules.items():
        exits = getattr(module, "exits", None)
        names_of = getattr(module, "trained_parameter_names", None)
        if exits and callable(names_of):
            return {int(e): set(names_of(int(e), prefix=f"{key}.")) for e in exits}
    return None


def _evaluate(task: ServerTask) -> dict[str, float]:
    if task.evaluate is not None:
        return {k: float(v) for k, v in task.evaluate(task.brain).items()}
    if task.valid_set is None:
        return {}
    loss = task.brain.evaluate(
        task.valid_set, progressbar=False, test_loader_kwargs=task.valid_loader_kwargs
    )
    return {"valid_loss": float(loss)}


def _fit_pull_interval(grid: Any, last_round: float | None) -> None:
    """Fit the in-memory Grid's reply polling to the round time (our choice: 2% of a round).

    Flower's ``InMemoryGrid.send_and_receive`` (the Simulation Engine's Grid) sleeps
    ``pull_interval`` (0.1 s by default) between polls for replies, about 0.05 s lost per
    ``send_and_receive`` on average, more than a whole round of a small model. The interval
    is set to 2% of the last round, within [5 ms, 100 ms] (20 ms before the first round);
    other Grids (the Deployment Engine's gRPC Grid) have no such attribute and are left alone.
    """
    if hasattr(grid, "pull_interval"):
        grid.pull_interval = 0.02 if last_round is None else min(0.1, max(0.005, last_round / 50))


def run_server(grid: Grid, task: ServerTask) -> ServerResult:
    """Run (or resume) the federated rounds of ``task`` on ``grid``.

    Holds the run lock of ``task.config.output_folder`` for the whole run
    (:func:`speechbrain_fl.utils.run_lock.hold_run_lock`; re-entrant, so a recipe script that
    holds it already goes on): a second run on the same folder stops at once with
    :class:`~speechbrain_fl.utils.run_lock.RunLockedError` naming the folder and the holder's
    pid. Under the lock, temporaries a killed run left at the folder's top level (the engine's
    files: ``.server_state.pt.*.tmp``, ``.rounds.csv.*.tmp``, ...) are removed first.

    Arguments
    ---------
    grid : flwr.serverapp.Grid
        The Grid given to the ServerApp.
    task : ServerTask
        The recipe's server side.

    Returns
    -------
    ServerResult
        The final global trainable tensors and epsilon.
    """
    with hold_run_lock(task.config.output_folder) as out:
        # the engine's own files are at the top level; a subfolder may be a cache that other
        # runs write too (the recipe sweeps what it owns, holding the same lock)
        sweep_stale_temporaries(out, recursive=False)
        return _run_server(grid, task)


def _evaluate_due(cfg: FLConfig, server_round: int) -> bool:
    return cfg.eval_every > 0 and (
        server_round % cfg.eval_every == 0 or server_round == cfg.num_rounds
    )


def round_meta(train_logger: TrainLogger, meta: Mapping[str, Any]) -> dict[str, Any]:
    """A round's ``stats_meta`` for ``train_logger``: as given for a ``FileTrainLogger`` (its
    text line, which a resume parses), the numeric values only for any other (a
    ``TensorboardLogger`` writes each as a scalar; ``round_failed`` becomes 1).

    Example
    -------
    >>> round_meta(object(), {"round": 2, "epsilon": "-", "round_failed": "yes"})
    {'round': 2, 'round_failed': 1}
    """
    if isinstance(train_logger, FileTrainLogger):
        return dict(meta)
    numeric = {k: v for k, v in meta.items() if isinstance(v, (int, float))}
    if meta.get("round_failed") == "yes":
        numeric["round_failed"] = 1
    return numeric


def _evaluate_isolated(task: ServerTask) -> dict[str, float]:
    """:func:`_evaluate` without touching the process RNG streams (the state holds them)."""
    states = capture_rng_states()
    try:
        return _evaluate(task)
    finally:
        restore_rng_states(states)


def _run_server(grid: Grid, task: ServerTask) -> ServerResult:
    """The round loop of :func:`run_server` (the run lock held)."""
    cfg = task.config
    out = Path(cfg.output_folder)
    layout = task.layout or default_layout(task.brain)
    strategy = DPFedAvg(
        config=cfg,
        layout=layout,
        min_available_nodes=task.min_available_nodes,
        population_size=task.num_partitions,
        partition_sizes=task.partition_sizes,
        depth_names=task.depth_names
        if task.depth_names is not None
        else model_depth_names(task.brain),
    )
    if strategy.population_size is not None and cfg.private:
        check_delta_population(cfg.delta, strategy.population_size)
    params = trainable_state(task.brain.modules)
    initial_fingerprint = params_fingerprint(params)
    state = load_state(out / STATE_FILE)
    train_logger = task.train_logger
    if train_logger is None:
        train_logger = FileTrainLogger(str(out / "train_log.txt"))
    # the file whose engine lines a resume truncates (none for e.g. a TensorboardLogger)
    log_path = Path(getattr(train_logger, "save_file", out / "train_log.txt"))
    if cfg.private and cfg.max_retries > 0:
        log(
            WARNING,
            "max_retries=%d is ignored: a private run releases every Poisson draw (a round "
            "with too few replies is released with its noise, never re-sampled)",
            cfg.max_retries,
        )

    def write_outputs(done: int, report, epsilon, metrics, accountant=None) -> None:
        """The round's rows and log lines: only ever after its state is committed.

        ``epsilon`` is the running figure of ``accountant`` (:meth:`DPFedAvg.round_epsilon`);
        the log line names it (``epsilon_rdp: 1.2``).
        """
        telemetry.write_round(done, report=report, epsilon=epsilon, metrics=metrics)
        meta: dict[str, Any] = {"round": done}
        if report is not None:
            key = "epsilon" if accountant is None else f"epsilon_{accountant}"
            meta[key] = epsilon if epsilon is not None else "-"
            if report.round_failed:
                meta["round_failed"] = "yes"
        train_logger.log_stats(
            stats_meta=round_meta(train_logger, meta),
            train_stats={"loss": report.train_loss}
            if report is not None and report.train_loss is not None
            else None,
            valid_stats=metrics or None,
        )

    if state is None:
        for stale in ("rounds.csv", "group_norms.csv"):
            (out / stale).unlink(missing_ok=True)
        truncate_train_log(log_path, -1)  # lines of a run whose state was removed
        start = 0
        metrics = _evaluate_isolated(task)
        metric_names = list(metrics)
        telemetry = RoundsTelemetry(out, layout, metric_names)
    else:
        # the privacy settings first: a changed C, delta, q, sigma, method, layout or K is named
        strategy.check_privacy_settings(
            state["strategy"].get("privacy"), source=str(out / STATE_FILE)
        )
        if set(state["params"]) != set(params):
            raise ValueError(
                f"{out / STATE_FILE} holds parameters {sorted(state['params'])[:5]}..., "
                f"the model has {sorted(params)[:5]}...: different model; use another output_folder"
            )
        saved_fingerprint = state.get("initial_fingerprint")
        if saved_fingerprint is not None and saved_fingerprint != initial_fingerprint:
            raise ValueError(
                f"{out / STATE_FILE} belongs to a run that started from other initial parameters "
                "(another seed model, corpus or model options); resuming it would mix two runs. "
                "Delete it or use another output_folder."
            )
        start = int(state["round"])
        params = state["params"]
        strategy.load_state_dict(state["strategy"], source=str(out / STATE_FILE))
        restore_rng_states(state["rng"])
        metric_names = state["metric_names"]
        telemetry = RoundsTelemetry(out, layout, metric_names)
        # rows and lines of rounds after the committed one (written by an older version) go
        telemetry.truncate(start)
        truncate_train_log(log_path, start)
        load_trainable(task.brain.modules, params)
        log(INFO, "resuming from %s after round %d", out / STATE_FILE, start)

    round_budgets: list[dict[str, float]] = list(state.get("round_budgets", [])) if state else []

    def save(done: int, outputs: dict[str, Any]) -> None:
        """Commit round ``done``: parameters, accountant, EMA, RNG and its pending outputs."""
        atomic_torch_save(
            {
                "round": done,
                "params": params,
                "strategy": strategy.state_dict(),
                "rng": capture_rng_states(),
                "metric_names": metric_names,
                "initial_fingerprint": initial_fingerprint,
                "round_budgets": round_budgets,
                "outputs": outputs,
            },
            out / STATE_FILE,
        )

    def running() -> tuple[float | None, str | None]:
        """The per-round figure and its accountant (``(None, None)`` without noise)."""
        figure = strategy.round_epsilon()
        return (None, None) if figure is None else figure

    if state is None:
        epsilon, accountant = running()
        save(0, {"report": None, "epsilon": epsilon, "epsilon_accountant": accountant,
                 "metrics": metrics})  # fmt: skip
        write_outputs(0, None, epsilon, metrics, accountant)
        log(
            INFO,
            "%s",
            progress_line(
                server_round=0,
                num_rounds=cfg.num_rounds,
                report=None,
                epsilon=None,
                metrics=metrics,
                started=0,
                rounds_done_here=0,
            ),
        )
    else:  # the committed round's rows, if the kill came between its commit and its writes
        _restore_outputs(task, state, telemetry, log_path, write_outputs)
    if strategy.accountant is not None:
        log(
            INFO,
            "privacy: q=%.4g sigma=%.4g delta=%g -> epsilon (%s) after %d rounds: %.4f; the "
            "per-round figures below are %s's",
            cfg.sampling_rate,
            cfg.noise_multiplier,
            cfg.delta,
            cfg.accountant,
            cfg.num_rounds,
            strategy.accountant.epsilon_after(cfg.num_rounds - start),
            cfg.round_accountant,
        )
    # the max_epsilon stop with the run's accountant, found once (DPFedAvg's accountant
    # max_rounds): round r may start iff rounds + 1 <= last_allowed, i.e. the per-round rule
    # epsilon_after(1) <= max_epsilon without a look-ahead epsilon every round
    last_allowed = (
        strategy.accountant.max_rounds(
            cfg.max_epsilon, limit=strategy.accountant.rounds + cfg.num_rounds - start
        )
        if strategy.accountant is not None and cfg.max_epsilon is not None
        else None
    )
    arrays = ArrayRecord({k: v.clone() for k, v in params.items()})
    started, stopped_early, done = time.time(), False, start
    round_seconds: list[float] = []
    reports: list[Any] = []
    _fit_pull_interval(grid, None)
    for server_round in range(start + 1, cfg.num_rounds + 1):
        round_start = time.time()
        if last_allowed is not None and strategy.accountant.rounds + 1 > last_allowed:
            upcoming = float(strategy.accountant.epsilon_after(1))  # cached by max_rounds
            log(
                WARNING,
                "stopping before round %d: epsilon (%s) would reach %.4f > max_epsilon=%g",
                server_round,
                cfg.accountant,
                upcoming,
                cfg.max_epsilon,
            )
            stopped_early = True
            break
        for attempt in range(cfg.max_retries + 1):
            strategy.learn_node_order(grid, timeout=cfg.round_timeout)
            messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
            replies = grid.send_and_receive(messages, timeout=cfg.round_timeout) if messages else []
            try:
                arrays, _ = strategy.aggregate_train(server_round, replies)
                break
            except RoundFailed as err:
                if attempt < cfg.max_retries:
                    log(WARNING, "%s; retrying (%d/%d)", err, attempt + 1, cfg.max_retries)
                    continue
                if not isinstance(err, AggregateFailed) and strategy.population < cfg.min_clients:
                    # no round can ever succeed: a configuration error, not a bad reply
                    raise RuntimeError(
                        f"{err}; only {strategy.population} nodes are connected. Lower "
                        "min_clients or connect more nodes"
                    ) from err
                log(
                    WARNING,
                    "%s; round %d is recorded as failed (after %d retries), the global model is "
                    "unchanged and the run goes on (see the 'dropped' lines above; lower "
                    "min_clients or raise sampling_rate if rounds keep failing)",
                    err,
                    server_round,
                    cfg.max_retries,
                )
        params = decode_record(arrays)  # arrays.to_torch_state_dict(), the header cached
        report, (epsilon, accountant) = strategy.last_report, running()
        reports.append(report)
        round_budgets.append(dict(report.component_budgets))
        # account first, then release: the accountant step, the new model and the round's
        # pending outputs are committed before anything derived from them is written
        save(
            server_round,
            {
                "report": _report_dict(report),
                "epsilon": epsilon,
                "epsilon_accountant": accountant,
            },
        )
        done = server_round
        round_seconds.append(time.time() - round_start)
        _fit_pull_interval(grid, round_seconds[-1])
        metrics = None
        if _evaluate_due(cfg, server_round):  # the Brain gets the global model when it is used
            load_trainable(task.brain.modules, params)
            metrics = _evaluate_isolated(task)
        write_outputs(server_round, report, epsilon, metrics, accountant)
        log(
            INFO,
            "%s",
            progress_line(
                server_round=server_round,
                num_rounds=cfg.num_rounds,
                report=report,
                epsilon=epsilon,
                metrics=metrics,
                started=started,
                rounds_done_here=server_round - start,
                accountant=accountant,
            ),
        )
    load_trainable(task.brain.modules, params)  # the server's Brain ends with the global model
    privacy = (
        privacy_report(
            layout,
            round_budgets,
            noise_multiplier=cfg.noise_multiplier,
            clip=cfg.clip,
            sampling_rate=cfg.sampling_rate,
            rounds=strategy.accountant.rounds,
            delta=cfg.delta,
            accountant=cfg.accountant,
        )
        if strategy.accountant is not None
        else None
    )
    if privacy is not None:
        log(
            INFO,
            "privacy: epsilon (%s) %.4f after %d rounds at delta=%g: the run's guarantee "
            "(results.json); Opacus RDP gives %.4f",
            cfg.accountant,
            privacy["epsilon"],
            strategy.accountant.rounds,
            cfg.delta,
            privacy["epsilon_rdp"],
        )
    if privacy is not None and cfg.audit_canaries:
        privacy["audit"] = _audit(strategy, params, cfg.output_folder)
    return ServerResult(
        params=params,
        epsilon=strategy.epsilon(),
        last_round=done,
        stopped_early=stopped_early,
        round_seconds=round_seconds,
        round_budgets=round_budgets,
        reports=reports,
        privacy=privacy,
    )


def _audit(strategy: DPFedAvg, params, output_folder) -> dict[str, Any] | None:
    """The canary audit's summary (results.json ``privacy.audit``) and its plot.

    ``plots/audit_cosines.png`` shows the two cosine distributions, drawn from memory; the
    canaries' directions, split and per-canary scores are never written.
    """
    audited = strategy.audit_report(params)
    if audited is None:
        return None
    summary, cosines, inserted = audited
    plot = Path(output_folder) / "plots" / "audit_cosines.png"
    plot_audit_cosines(cosines, inserted, summary, plot)
    summary["plot"] = str(plot)
    log(
        INFO,
        "audit: accountant epsilon %.4g (%d rounds), one-shot estimate %s, lower bound %.4g "
        "at %.0f%% (%d canaries)",
        summary["accountant_epsilon"],
        summary["rounds"],
        "n/a" if summary["epsilon_one_shot"] is None else f"{summary['epsilon_one_shot']:.4g}",
        summary["epsilon_lower_bound"],
        100 * summary["confidence"],
        summary["canaries"],
    )
    if summary["exceeds_accountant"]:
        log(WARNING, "audit: an audited epsilon exceeds the accountant's: check the mechanism")
    return summary


def _restore_outputs(task, state, telemetry, log_path, write_outputs) -> None:
    """Write the committed round's rows and log line when a kill left them unwritten."""
    outputs = state.get("outputs")
    done = int(state["round"])
    if outputs is None or telemetry.last_round() >= done:
        return
    report = None if outputs["report"] is None else RoundReport(**outputs["report"])
    metrics = outputs.get("metrics")
    if metrics is None and done > 0 and _evaluate_due(task.config, done):
        metrics = _evaluate_isolated(task)
    if done in train_log_rounds(log_path):
        truncate_train_log(log_path, done - 1)
    # a state written before the per-round accountant was recorded held the run's accountant
    accountant = outputs.get("epsilon_accountant", task.config.accountant)
    write_outputs(done, report, outputs["epsilon"], metrics, accountant if report else None)
    log(INFO, "round %d: its outputs were committed but not written before the kill; written", done)


def _report_dict(report: RoundReport) -> dict[str, Any]:
    """``dataclasses.asdict(report)`` for :class:`RoundReport`, whose fields are numbers,
    strings, ``None`` and flat lists and dicts of those: the containers are copied one level
    (``asdict`` deep-copies every leaf, ~80 us a round).

    Example
    -------
    >>> r = RoundReport(round=1, cohort_size=2, population=4, num_replied=2, num_failed=0)
    >>> _report_dict(r) == dataclasses.asdict(r)
    True
    """
    out = {}
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        if isinstance(value, dict):
            value = dict(value)
        elif isinstance(value, list):
            value = list(value)
        out[f.name] = value
    return out


def make_server_app(
    build_server: Callable[[Context], ServerTask],
    *,
    on_result: Callable[[ServerResult], None] | None = None,
) -> ServerApp:
    """Return a Flower ServerApp that runs :func:`run_server` on ``build_server(context)``.

    Arguments
    ---------
    build_server : callable
        ``build_server(context) -> ServerTask``.
    on_result : callable, optional
        Receives the :class:`ServerResult` when the run ends.

    Returns
    -------
    flwr.serverapp.ServerApp

    Example
    -------
    >>> from speechbrain_fl.fl.toy import toy_server
    >>> app = make_server_app(toy_server)
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result = run_server(grid, build_server(context))
        if on_result is not None:
            on_result(result)

    return app

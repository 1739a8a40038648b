"""The server's round loop, in named steps (:func:`speechbrain_fl.fl.serverapp.main.run_server`):
:class:`RoundLoop` carries the strategy, the global tensors and the telemetry across rounds:
:meth:`~RoundLoop.start` (fresh or resumed), per round :meth:`~RoundLoop.budget_exhausted`,
:meth:`~RoundLoop.train_round` (with retries) and :meth:`~RoundLoop.commit_round`, then
:meth:`~RoundLoop.finish` (the privacy report).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from speechbrain.utils.train_logger import FileTrainLogger, TrainLogger

from speechbrain_fl.fl.aggregate.round_report import (
    AggregateFailed,
    RoundFailed,
    RoundReport,
    UnreadableTally,
)
from speechbrain_fl.fl.dp.budget_log import BudgetLog
from speechbrain_fl.fl.dp.disclosure import simulation_label
from speechbrain_fl.fl.npy_codec import decode_record
from speechbrain_fl.fl.params import load_trainable, params_fingerprint, trainable_state
from speechbrain_fl.fl.secagg.train_stage import secure_train_round
from speechbrain_fl.fl.serverapp.state import (
    STATE_FILE,
    atomic_torch_save,
    capture_rng_states,
    load_state,
    restore_rng_states,
)
from speechbrain_fl.fl.serverapp.strategy import DPFedAvg
from speechbrain_fl.fl.serverapp.task import (
    ServerResult,
    ServerTask,
    default_layout,
    model_depth_names,
)
from speechbrain_fl.fl.serverapp.telemetry import (
    RoundsTelemetry,
    progress_line,
    train_log_rounds,
    truncate_train_log,
)
from speechbrain_fl.fl.settings.checks import check_delta_population
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy.accounting import privacy_report
from speechbrain_fl.privacy.audit import plot_audit_cosines

__all__ = ["RoundLoop", "round_meta"]


class RoundLoop:
    """One run of the federated rounds of ``task`` on ``grid`` (the run lock held).

    Arguments
    ---------
    grid : flwr.serverapp.Grid
        The Grid given to the ServerApp.
    task : ServerTask
        The recipe's server side.
    """

    def __init__(self, grid: Grid, task: ServerTask) -> None:
        self.grid, self.task, self.cfg = grid, task, task.config
        self.out = Path(self.cfg.output_folder)
        self.layout = task.layout or default_layout(task.brain)
        self.strategy = _make_strategy(task, self.layout)
        self.params = trainable_state(task.brain.modules)
        self.initial_fingerprint = params_fingerprint(self.params)
        self.train_logger = task.train_logger or FileTrainLogger(str(self.out / "train_log.txt"))
        # the file whose engine lines a resume truncates (none for e.g. a TensorboardLogger)
        self.log_path = Path(getattr(self.train_logger, "save_file", self.out / "train_log.txt"))
        self.telemetry: RoundsTelemetry | None = None
        self.metric_names: list[str] = []
        # every round's component budgets, for the privacy report (not in the state: it would
        # grow with the rounds); only a clipping run has budgets
        self.budget_log = BudgetLog(self.out) if self.cfg.clip is not None else None
        self.reports: list[Any] = []
        self.unreadable = UnreadableTally()  # over the whole run: kept in the state
        self.round_seconds: list[float] = []
        if self.cfg.private and self.cfg.max_retries > 0:
            log(
                WARNING,
                "max_retries=%d is ignored: a private run releases every Poisson draw (a round "
                "with too few replies is released with its noise, never re-sampled)",
                self.cfg.max_retries,
            )

    # -- outputs and commits ----------------------------------------------------------------
    def write_outputs(self, done: int, report, epsilon, metrics, accountant=None) -> None:
        """The round's rows and log lines: only ever after its state is committed.

        ``epsilon`` is the running figure of ``accountant`` (:meth:`DPFedAvg.round_epsilon`);
        the log line names it (``epsilon_rdp: 1.2``).
        """
        if report is not None and self.budget_log is not None:  # first: see _restore_outputs
            self.budget_log.append(done, report.component_budgets)
        self.telemetry.write_round(done, report=report, epsilon=epsilon, metrics=metrics)
        meta: dict[str, Any] = {"round": done}
        if report is not None:
            key = "epsilon" if accountant is None else f"epsilon_{accountant}"
            meta[key] = epsilon if epsilon is not None else "-"
            if report.round_failed:
                meta["round_failed"] = "yes"
        self.train_logger.log_stats(
            stats_meta=round_meta(self.train_logger, meta),
            train_stats={"loss": report.train_loss}
            if report is not None and report.train_loss is not None
            else None,
            valid_stats=metrics or None,
        )

    def save(self, done: int, outputs: dict[str, Any]) -> None:
        """Commit round ``done``: parameters, accountant, EMA, RNG and its pending outputs.

        Only what a resume needs, whose size does not depend on the round: the per-round
        history is in the output files (``rounds.csv``, ``budgets.csv``).
        """
        atomic_torch_save(
            {
                "round": done,
                "params": self.params,
                "strategy": self.strategy.state_dict(),
                "rng": capture_rng_states(),
                "metric_names": self.metric_names,
                "initial_fingerprint": self.initial_fingerprint,
                "outputs": outputs,
                "unreadable": self.unreadable.as_dict(),
            },
            self.out / STATE_FILE,
        )

    def running(self) -> tuple[float | None, str | None]:
        """The per-round figure and its accountant (``(None, None)`` without noise)."""
        figure = self.strategy.round_epsilon()
        return (None, None) if figure is None else figure

    def log_progress(self, server_round: int, report, epsilon, metrics, **extra: Any) -> None:
        """The progress line of ``server_round`` (:func:`speechbrain_fl.fl.serverapp.telemetry.progress_line`)."""
        log(
            INFO,
            "%s",
            progress_line(
                server_round=server_round,
                num_rounds=self.cfg.num_rounds,
                report=report,
                epsilon=epsilon,
                metrics=metrics,
                **extra,
            ),
        )

    # -- start: fresh or resumed ------------------------------------------------------------
    def start(self) -> int:
        """Start fresh (round 0 evaluated and committed) or resume; the last committed round."""
        state = load_state(self.out / STATE_FILE)
        if state is None:
            return self._start_fresh()
        start = self._resume(state)
        # the committed round's rows, if the kill came between its commit and its writes
        _restore_outputs(self.task, state, self.telemetry, self.log_path, self.write_outputs)
        return start

    def _start_fresh(self) -> int:
        for stale in ("rounds.csv", "group_norms.csv", BudgetLog(self.out).path.name):
            (self.out / stale).unlink(missing_ok=True)
        truncate_train_log(self.log_path, -1)  # lines of a run whose state was removed
        metrics = _evaluate_isolated(self.task)
        self.metric_names = list(metrics) + self.strategy.adaptive_columns()  # C_t columns
        self.telemetry = RoundsTelemetry(self.out, self.layout, self.metric_names)
        epsilon, accountant = self.running()
        self.save(0, {"report": None, "epsilon": epsilon, "epsilon_accountant": accountant,
                      "metrics": metrics})  # fmt: skip
        self.write_outputs(0, None, epsilon, metrics, accountant)
        self.log_progress(0, None, None, metrics, started=0, rounds_done_here=0)
        return 0

    def _resume(self, state: Mapping[str, Any]) -> int:
        source = self.out / STATE_FILE
        # the privacy settings first: a changed C, delta, q, sigma, method, layout or K is named
        self.strategy.check_privacy_settings(state["strategy"].get("privacy"), source=str(source))
        if set(state["params"]) != set(self.params):
            raise ValueError(
                f"{source} holds parameters {sorted(state['params'])[:5]}..., the model has "
                f"{sorted(self.params)[:5]}...: different model; use another output_folder"
            )
        saved_fingerprint = state.get("initial_fingerprint")
        if saved_fingerprint is not None and saved_fingerprint != self.initial_fingerprint:
            raise ValueError(
                f"{source} belongs to a run that started from other initial parameters "
                "(another seed model, corpus or model options); resuming it would mix two runs. "
                "Delete it or use another output_folder."
            )
        start = int(state["round"])
        self.params = state["params"]
        self.strategy.load_state_dict(state["strategy"], source=str(source))
        restore_rng_states(state["rng"])
        self.metric_names = state["metric_names"]
        self.unreadable = UnreadableTally(**state.get("unreadable", {}))
        self.telemetry = RoundsTelemetry(self.out, self.layout, self.metric_names)
        # rows and lines of rounds after the committed one (written by an older version) go
        self.telemetry.truncate(start)
        if self.budget_log is not None:
            self.budget_log.truncate(start)
        truncate_train_log(self.log_path, start)
        load_trainable(self.task.brain.modules, self.params)
        log(INFO, "resuming from %s after round %d", source, start)
        return start

    # -- the rounds -------------------------------------------------------------------------
    def last_allowed_round(self, start: int) -> int | None:
        """The last accountant round within ``max_epsilon`` (None: no limit), found once.

        Round r may start iff rounds + 1 <= last_allowed: the per-round rule
        epsilon_after(1) <= max_epsilon without a look-ahead epsilon every round.
        """
        cfg, accountant = self.cfg, self.strategy.accountant
        if accountant is None:
            return None
        log(
            INFO,
            "privacy: q=%.4g sigma=%.4g delta=%g -> epsilon (%s) after %d rounds: %.4f; the "
            "per-round figures below are %s's%s",
            accountant.sampling_rate,
            cfg.noise_multiplier,
            cfg.delta,
            cfg.accountant,
            cfg.num_rounds,
            accountant.epsilon_after(cfg.num_rounds - start),
            cfg.round_accountant,
            simulation_label(cfg),
        )
        if cfg.max_epsilon is None:
            return None
        limit = accountant.rounds + cfg.num_rounds - start
        return accountant.max_rounds(cfg.max_epsilon, limit=limit)

    def budget_exhausted(self, server_round: int, last_allowed: int | None) -> bool:
        """Whether ``server_round`` would exceed ``max_epsilon`` (logged when it would)."""
        accountant = self.strategy.accountant
        if last_allowed is None or accountant.rounds + 1 <= last_allowed:
            return False
        log(
            WARNING,
            "stopping before round %d: epsilon (%s) would reach %.4f > max_epsilon=%g",
            server_round,
            self.cfg.accountant,
            float(accountant.epsilon_after(1)),  # cached by max_rounds
            self.cfg.max_epsilon,
        )
        return True

    def train_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """Sample, send, aggregate; retries (non-private) and failed rounds as documented."""
        cfg, strategy = self.cfg, self.strategy
        for attempt in range(cfg.max_retries + 1):
            try:
                return self._train_once(server_round, arrays)
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
        return arrays

    def _train_once(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """One draw of the round: the plain train stage, or SecAgg+'s (``secure_aggregation``)."""
        cfg, strategy, grid = self.cfg, self.strategy, self.grid
        if cfg.secure_aggregation is not None:
            return secure_train_round(grid, strategy, server_round, arrays)
        strategy.learn_node_order(grid, timeout=cfg.round_timeout)
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        replies = grid.send_and_receive(messages, timeout=cfg.round_timeout) if messages else []
        return strategy.aggregate_train(server_round, replies)[0]

    def commit_round(self, server_round: int, arrays: ArrayRecord, **progress: Any) -> None:
        """Account, commit, then evaluate and write the round's outputs (in that order)."""
        self.params = decode_record(arrays)  # arrays.to_torch_state_dict(), the header cached
        report, (epsilon, accountant) = self.strategy.last_report, self.running()
        self.reports.append(report)
        self.unreadable.add(report)
        # account first, then release: the accountant step, the new model and the round's
        # pending outputs are committed before anything derived from them is written
        self.save(
            server_round,
            {"report": _report_dict(report), "epsilon": epsilon, "epsilon_accountant": accountant},
        )
        self.round_seconds.append(time.time() - progress.pop("round_start"))
        _fit_pull_interval(self.grid, self.round_seconds[-1])
        metrics = None
        if _evaluate_due(self.cfg, server_round):  # the Brain gets the global model when used
            load_trainable(self.task.brain.modules, self.params)
            metrics = _evaluate_isolated(self.task)
        self.write_outputs(server_round, report, epsilon, metrics, accountant)
        _log_unreadable(report)
        self.log_progress(server_round, report, epsilon, metrics, accountant=accountant, **progress)

    def run(self) -> ServerResult:
        """Every round from the last committed one to ``num_rounds``; the run's result."""
        start = self.start()
        last_allowed = self.last_allowed_round(start)
        arrays = ArrayRecord({k: v.clone() for k, v in self.params.items()})
        started, stopped_early, done = time.time(), False, start
        _fit_pull_interval(self.grid, None)
        for server_round in range(start + 1, self.cfg.num_rounds + 1):
            round_start = time.time()
            if self.budget_exhausted(server_round, last_allowed):
                stopped_early = True
                break
            arrays = self.train_round(server_round, arrays)
            self.commit_round(
                server_round,
                arrays,
                round_start=round_start,
                started=started,
                rounds_done_here=server_round - start,
            )
            done = server_round
        load_trainable(self.task.brain.modules, self.params)  # the Brain ends with the global model
        return ServerResult(
            params=self.params,
            epsilon=self.strategy.epsilon(),
            last_round=done,
            stopped_early=stopped_early,
            round_seconds=self.round_seconds,
            round_budgets=self.round_budgets(),
            reports=self.reports,
            privacy=self.finish(),
            config=self.cfg,
            unreadable_in_training=self.unreadable.as_dict(),
        )

    def round_budgets(self) -> list[dict[str, float]]:
        """Every trained round's component budgets (``budgets.csv``; none without a clip)."""
        return [] if self.budget_log is None else self.budget_log.read()

    def finish(self) -> dict[str, Any] | None:
        """The run's privacy report (results.json ``privacy``; None without noise), audited."""
        cfg, strategy = self.cfg, self.strategy
        if strategy.accountant is None:
            return None
        privacy = privacy_report(
            self.layout,
            self.round_budgets(),
            noise_multiplier=cfg.noise_multiplier,
            clip=cfg.clip,
            sampling_rate=strategy.accountant.sampling_rate,
            rounds=strategy.accountant.rounds,
            delta=cfg.delta,
            accountant=cfg.accountant,
        )
        log(
            INFO,
            "privacy: epsilon (%s) %.4f after %d rounds at delta=%g: the run's guarantee "
            "(results.json); Opacus RDP gives %.4f%s",
            cfg.accountant,
            privacy["epsilon"],
            strategy.accountant.rounds,
            cfg.delta,
            privacy["epsilon_rdp"],
            simulation_label(cfg),
        )
        privacy.update(strategy.privacy_extras(self.round_budgets()))  # simulated, adaptive
        if cfg.audit_canaries:
            privacy["audit"] = _audit(strategy, self.params, cfg.output_folder)
        return privacy


def _make_strategy(task: ServerTask, layout) -> DPFedAvg:
    """The run's :class:`DPFedAvg` (the declared population checked against delta)."""
    strategy = DPFedAvg(
        config=task.config,
        layout=layout,
        min_available_nodes=task.min_available_nodes,
        population_size=task.num_partitions,
        partition_sizes=task.partition_sizes,
        depth_names=task.depth_names
        if task.depth_names is not None
        else model_depth_names(task.brain),
    )
    if strategy.population_size is not None and task.config.private:
        check_delta_population(task.config.delta, strategy.population_size)
    return strategy


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


def _log_unreadable(report: RoundReport | None) -> None:
    """One warning for a round whose replies skipped undecodable utterances, naming the
    partitions left with none readable (their updates were zero)."""
    if report is None or not (report.unreadable_utterances or report.none_readable):
        return
    log(
        WARNING,
        "round %d: %d training utterances failed to decode and were skipped by the clients%s",
        report.round,
        report.unreadable_utterances,
        f"; no readable utterance at partitions {report.none_readable} (zero updates)"
        if report.none_readable
        else "",
    )


def _report_dict(report: RoundReport) -> dict[str, Any]:
    """``dataclasses.asdict(report)`` for :class:`RoundReport`, whose fields are numbers,
    strings, ``None`` and flat lists and dicts of those: the containers are copied one level
    (``asdict`` deep-copies every leaf).

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

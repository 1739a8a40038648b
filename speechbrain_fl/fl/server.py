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
``FileTrainLogger`` gets the numeric meta values only: no ``"-"`` for a run without epsilon).
A resume whose privacy settings (C, delta, q, sigma, method and its settings, layout,
declared population) differ from the saved ones is refused with an error naming the key, both
values and the state file. The loop itself, in named steps, is
:class:`~speechbrain_fl.fl.server_loop.RoundLoop`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import speechbrain as sb
import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from speechbrain.utils.train_logger import TrainLogger

from speechbrain_fl.privacy import Group, Layout
from speechbrain_fl.utils.atomic import sweep_stale_temporaries
from speechbrain_fl.utils.run_lock import hold_run_lock

from .config import FLConfig
from .params import trainable_parameters

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
        (``RoundReport.component_budgets``; ``{}`` for a flat budget over several components),
        as recorded in ``budgets.csv``; empty for a run without clipping.
    reports : list of RoundReport
        The rounds run by this process (norms, clip rates, budgets).
    privacy : dict, optional
        :func:`speechbrain_fl.privacy.accounting.privacy_report` of the run (``None`` without
        noise).
    config : FLConfig, optional
        The configuration the run ran with (the task's, built once by the recipe's factory):
        a report reads it from here instead of building its own.
    """

    params: dict[str, torch.Tensor]
    epsilon: float | None
    last_round: int
    stopped_early: bool = False
    round_seconds: list[float] = field(default_factory=list)
    round_budgets: list[dict[str, float]] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)
    privacy: dict[str, Any] | None = None
    config: FLConfig | None = None


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
        # imported here: the loop module builds on this one's ServerTask and ServerResult
        from .server_loop import RoundLoop

        return RoundLoop(grid, task).run()


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

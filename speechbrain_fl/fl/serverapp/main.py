"""ServerApp factory and the round loop (training, central evaluation, telemetry, resume).

The recipe supplies ``build_server(context) -> ServerTask``; :func:`run_server` runs the rounds
(the steps in its notes, the loop itself in :mod:`speechbrain_fl.fl.serverapp.loop`). Only the
``requires_grad`` parameters of ``brain.modules`` are federated.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from speechbrain_fl.fl.serverapp.loop import RoundLoop
from speechbrain_fl.fl.serverapp.task import (
    ServerResult,
    ServerTask,
)
from speechbrain_fl.utils.atomic import sweep_stale_temporaries
from speechbrain_fl.utils.run_lock import hold_run_lock

__all__ = ["make_server_app", "run_server"]


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

    Notes
    -----
    The recipe supplies ``build_server(context) -> ServerTask``: the Brain holding the starting
    global model (built without a checkpointer, like the client's), the :class:`FLConfig`, the
    privacy layout and the validation data or an evaluation function. Only the ``requires_grad``
    parameters of ``brain.modules`` are federated; frozen weights never cross the wire.

    Decision: the loop is written here instead of calling ``Strategy.start`` because ``start``
    always begins at round 1 and offers no hook to checkpoint after a round, to retry a round that
    got too few replies, or to stop before a round that would exceed ``max_epsilon``. It calls the
    strategy exactly as ``start`` does (``configure_train`` -> ``grid.send_and_receive`` ->
    ``aggregate_train``), so any :class:`flwr.serverapp.strategy.Strategy` hook behaviour is kept.

    Per round: refuse to start if the run's accountant says it would exceed ``max_epsilon`` (the
    last round within it is found once,
    :meth:`~speechbrain_fl.privacy.PrivacyAccountant.max_rounds`); train (a non-private run retries
    up to ``max_retries`` times on :class:`~speechbrain_fl.fl.aggregate.round_report.RoundFailed`,
    then records the round as failed, keeps the global model and goes on: no reply can end a run;
    it stops only when fewer nodes are connected than ``min_clients``; a private run releases every
    draw and never retries); evaluate every ``eval_every`` rounds and at the last round (round 0 is
    always evaluated; the server's Brain is given the global model for an evaluation and at the end
    of the run, not in the rounds between); commit the state atomically
    (:mod:`speechbrain_fl.fl.serverapp.state`: the accountant step, the new model, the round's
    pending outputs), then evaluate, append to ``rounds.csv``/``group_norms.csv`` and
    ``train_log.txt`` and log a progress line: nothing derived from a round's (noisy) aggregate is
    written before the round is committed. The round lines go through the task's ``train_logger``
    (the recipe YAML's, as in any SpeechBrain recipe; default SpeechBrain's ``FileTrainLogger`` on
    ``<output_folder>/train_log.txt``): ``stats_meta={"round": r, "epsilon_rdp": e}`` (the running
    figure, keyed by its accountant, FLConfig ``round_accountant``), ``train_stats= {"loss":
    ...}``, ``valid_stats`` = the evaluation's metrics (e.g. ``WER``), so a ``TensorboardLogger``
    shows rounds, losses, metrics and epsilon (a logger other than a ``FileTrainLogger`` gets the
    numeric meta values only: no ``"-"`` for a run without epsilon). A resume whose privacy
    settings (C, delta, q, sigma, method and its settings, layout, declared population) differ from
    the saved ones is refused with an error naming the key, both values and the state file. The
    loop itself, in named steps, is :class:`~speechbrain_fl.fl.serverapp.loop.RoundLoop`.
    """
    with hold_run_lock(task.config.output_folder) as out:
        # the engine's own files are at the top level; a subfolder may be a cache that other
        # runs write too (the recipe sweeps what it owns, holding the same lock)
        sweep_stale_temporaries(out, recursive=False)
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

"""What a recipe hands the engine's server side, and what the run gives back.

:class:`ServerTask` is the recipe's server half (the Brain holding the starting global model,
the :class:`~speechbrain_fl.fl.settings.config.FLConfig`, the privacy layout, the evaluation);
:class:`ServerResult` what :func:`speechbrain_fl.fl.serverapp.main.run_server` returns. Both live apart
from the round loop (:mod:`speechbrain_fl.fl.serverapp.loop`) and the ServerApp factory
(:mod:`speechbrain_fl.fl.serverapp.main`), which build on them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import speechbrain as sb
import torch
from speechbrain.utils.train_logger import TrainLogger

from speechbrain_fl.fl.params import trainable_parameters
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy import Group, Layout

__all__ = ["ServerResult", "ServerTask", "default_layout", "model_depth_names"]


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
        ``num-examples`` must not exceed its partition's (:mod:`speechbrain_fl.fl.serverapp.replies`). In deployment
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
    unreadable_in_training : dict, optional
        The training utterances whose audio failed to decode, over the whole run (resumed
        runs included): :meth:`speechbrain_fl.fl.aggregate.round_report.UnreadableTally.as_dict`
        (results.json ``data.unreadable_in_training``).
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
    unreadable_in_training: dict[str, Any] = field(default_factory=dict)


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

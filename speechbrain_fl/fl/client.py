"""ClientApp factory: a SpeechBrain ``Brain`` trained locally by ``brain.fit``.

The recipe supplies ``build_client(context) -> ClientTask``: the Brain (built *without* a
checkpointer, since ``Brain.on_fit_start`` would otherwise recover an old checkpoint over the
global parameters), this client's training set and loader options, and optionally the privacy
layout (for module-level groups and component labels; without it every tensor is its own group
of component ``all``). The built task is cached per partition inside the worker process, so a
simulation actor or a SuperNode builds the Brain and reads its manifest once, not every round.
The cache is a module-level dict (:data:`_TASKS`), not a closure of the ClientApp: Flower's
Simulation Engine pickles the ClientApp with every message, so a closure would arrive empty in
every message. It is keyed by the builder's ``cache_key`` attribute (a
:class:`~speechbrain_fl.fl.task.TaskSpec` builder has one), the run and the partition; a builder
without a ``cache_key`` is cached per ClientApp object only (one hit per unpickled copy).

One training message: load the global *trainable* tensors (exactly the names in the ArrayRecord,
which must all be ``requires_grad`` parameters of ``brain.modules``), set ``brain.fl_round`` and
``brain.fl_num_rounds`` from the round's config (for schedules that span the run), seed torch
with the round seed plus the partition id (reproducible runs and resumes), run ``brain.fit`` for
``local-epochs`` epochs, read the loss the Brain passes to ``on_stage_end`` (recorded by a
wrapper around the instance's hook, so ``Brain.fit`` is neither copied nor overridden), compute
delta = local - global, clip it with the budgets from the ConfigRecord
(:func:`speechbrain_fl.privacy.clip_update`) and reply with the clipped delta and a MetricRecord:
``num-examples``, ``train-loss``, and, when clipping or when the server sends ``clip-groups``
without budgets (FLConfig ``record_norms``: measured, nothing clipped), the pre-clip ``group-norms``,
``group-clipped``, ``component-norms``, ``component-clipped`` (lists in the order the server
sent), ``joint-norm`` and ``clip-ratio``. The model is reset to the global parameters after each
round, so a cached Brain never carries local state into the next round.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import speechbrain as sb
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from speechbrain_fl.privacy import Layout, clip_update

from .params import load_trainable, trainable_parameters

__all__ = ["ClientTask", "make_client_app", "train_round"]

# Built ClientTasks of this process, least recently used first (see the module docstring).
_TASKS: OrderedDict[Any, ClientTask] = OrderedDict()


@dataclass
class ClientTask:
    """What a client trains.

    Arguments
    ---------
    brain : speechbrain.Brain
        The model, without a checkpointer.
    train_set : torch.utils.data.Dataset or DataLoader
        The client's training data.
    train_loader_kwargs : dict
        Passed to ``brain.fit`` (batch size, collate function, ...).
    layout : speechbrain_fl.privacy.Layout, optional
        Groups and components for clipping.
    partial : callable, optional
        ``partial(brain) -> (names, metrics)``, called after local training: the reply then
        carries only the tensors in ``names`` (those this client trained, for a rule with
        ``accepts_partial`` such as :mod:`.layerwise`) and adds ``metrics`` (e.g. the
        client's ``exit-depth``) to its MetricRecord.
    """

    brain: sb.Brain
    train_set: Any
    train_loader_kwargs: dict[str, Any] = field(default_factory=dict)
    layout: Layout | None = None
    partial: Callable[[sb.Brain], tuple[Any, dict[str, Any]]] | None = None

    def __post_init__(self) -> None:
        if getattr(self.brain, "checkpointer", None) is not None:
            raise ValueError(
                "ClientTask.brain has a checkpointer: Brain.fit would recover it over the "
                "global parameters; build the client Brain with checkpointer=None"
            )


@contextlib.contextmanager
def _record_stage_end(brain: sb.Brain) -> Iterator[list[tuple[Any, float]]]:
    """Record ``(stage, loss)`` from ``brain.on_stage_end`` calls (instance-level wrapper)."""
    records: list[tuple[Any, float]] = []
    original = brain.on_stage_end

    def hook(stage, stage_loss, epoch=None):
        records.append((stage, float(stage_loss)))
        return original(stage, stage_loss, epoch)

    own = brain.__dict__.get("on_stage_end")
    brain.on_stage_end = hook
    try:
        yield records
    finally:
        if own is None:
            del brain.on_stage_end  # back to the class method
        else:
            brain.on_stage_end = own


#: The bound used when the server asks for group norms without clipping (``clip-groups`` and
#: no ``clip-budgets``): no finite update reaches it, so nothing is clipped.
NORMS_ONLY_BUDGET = 1e300


def _client_metrics(stats: Any, groups: list[str], comps: list[str]) -> dict[str, Any]:
    return {
        "group-norms": [float(stats.group_norms.get(g, 0.0)) for g in groups],
        "group-clipped": [float(bool(stats.clipped.get(g, False))) for g in groups],
        "component-norms": [float(stats.component_norms.get(c, 0.0)) for c in comps],
        "component-clipped": [float(bool(stats.component_clipped.get(c, False))) for c in comps],
        "joint-norm": float(stats.joint_norm),
        "clip-ratio": float(stats.clip_ratio),
    }


def train_round(task: ClientTask, content: RecordDict, *, partition_id: int = 0) -> RecordDict:
    """Run one local round on ``task`` for a training message's content.

    Arguments
    ---------
    task : ClientTask
        The client's Brain and data.
    content : flwr.app.RecordDict
        The message content: ``arrays`` (global trainable tensors) and ``config``.
    partition_id : int
        Added to the round seed.

    Returns
    -------
    flwr.app.RecordDict
        ``arrays`` (clipped delta) and ``metrics``.
    """
    config = content["config"]
    global_params = content["arrays"].to_torch_state_dict()
    params = trainable_parameters(task.brain.modules)
    load_trainable(task.brain.modules, global_params)
    torch.manual_seed(int(config.get("round-seed", 0)) + int(partition_id))
    epochs = int(config.get("local-epochs", 1))
    # The round's position, for Brains whose schedules span the federated run (e.g. a cosine
    # learning-rate decay over rounds read in ``init_optimizers``).
    task.brain.fl_round = int(config.get("server-round", 1))
    task.brain.fl_num_rounds = int(config.get("num-rounds", 1))
    try:
        with _record_stage_end(task.brain) as records:
            task.brain.fit(
                range(1, epochs + 1),
                task.train_set,
                progressbar=False,
                train_loader_kwargs=task.train_loader_kwargs,
            )
        with torch.no_grad():
            delta = {
                n: params[n].detach().cpu().to(torch.float32) - v.to(torch.float32)
                for n, v in global_params.items()
            }
    finally:  # never keep local state between rounds
        load_trainable(task.brain.modules, global_params)
    train_losses = [loss for stage, loss in records if stage == sb.Stage.TRAIN]
    metrics: dict[str, Any] = {
        "num-examples": len(task.train_set),
        "train-loss": train_losses[-1] if train_losses else float("nan"),
    }
    if task.partial is not None:
        names, extra = task.partial(task.brain)
        names = set(names)
        unknown = sorted(names - set(delta))
        if unknown:
            raise KeyError(
                f"ClientTask.partial named tensors {unknown[:5]} not in the global model"
            )
        delta = {n: v for n, v in delta.items() if n in names}
        metrics.update(extra)
    if "clip-budgets" in config or "clip-groups" in config:
        # no budgets but groups asked for (a non-DP run recording norms): a bound no update
        # reaches, so the statistics are measured and every tensor is returned unchanged
        budgets = json.loads(str(config.get("clip-budgets", json.dumps(NORMS_ONLY_BUDGET))))
        delta, stats = clip_update(delta, budgets, layout=task.layout, inplace=True)
        metrics.update(
            _client_metrics(
                stats,
                json.loads(str(config["clip-groups"])),
                json.loads(str(config["clip-components"])),
            )
        )
    return RecordDict({"arrays": ArrayRecord(delta), "metrics": MetricRecord(metrics)})


def _process_cache() -> OrderedDict[Any, ClientTask]:
    """This process's built ClientTasks (see the module docstring)."""
    return _TASKS


def make_client_app(
    build_client: Callable[[Context], ClientTask], *, cache_size: int = 4
) -> ClientApp:
    """Return a Flower ClientApp that trains the recipe's Brain with ``brain.fit``.

    Arguments
    ---------
    build_client : callable
        ``build_client(context) -> ClientTask``; ``context.node_config`` holds
        ``partition-id`` and ``num-partitions``.
    cache_size : int
        Built tasks kept per worker process (least recently used are dropped).

    Returns
    -------
    flwr.clientapp.ClientApp
        With a ``@app.train()`` handler (evaluation is central, on the server) and a
        ``@app.query()`` handler answering the node's ``partition-id``.

    Example
    -------
    >>> from speechbrain_fl.fl.toy import toy_client
    >>> app = make_client_app(toy_client)
    """
    app = ClientApp()
    shared_key = getattr(build_client, "cache_key", None)
    own_cache: OrderedDict[Any, ClientTask] = OrderedDict()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        partition_id = int(context.node_config.get("partition-id", 0))
        key = (shared_key, context.run_id, partition_id)
        # _process_cache is found by name in the worker (pickled by reference), so it is the
        # worker's own dict; a dict captured here would be pickled along with the app.
        cache = _process_cache() if shared_key is not None else own_cache
        if key not in cache:
            while len(cache) >= max(1, cache_size):
                cache.popitem(last=False)
            cache[key] = build_client(context)
        cache.move_to_end(key)
        content = train_round(cache[key], msg.content, partition_id=partition_id)
        content["metrics"]["partition-id"] = partition_id
        return Message(content=content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        partition_id = int(context.node_config.get("partition-id", 0))
        metrics = MetricRecord({"partition-id": partition_id})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app

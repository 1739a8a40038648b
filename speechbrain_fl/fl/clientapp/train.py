"""ClientApp factory: a SpeechBrain ``Brain`` trained locally (``Brain.fit``'s calls, see
:func:`speechbrain_fl.fl.clientapp.local_fit.lean_fit`).

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
with the round seed plus the partition id (reproducible runs and resumes), train for
``local-epochs`` epochs (:func:`speechbrain_fl.fl.clientapp.local_fit.lean_fit`, or ``brain.fit`` where that does not
apply), read the loss the Brain passes to ``on_stage_end`` (recorded by a wrapper around the
instance's hook, so neither the Brain's class nor its hooks are changed), compute
delta = local - global, clip it with the budgets from the ConfigRecord
(:func:`speechbrain_fl.privacy.clip_update`) and reply with the clipped delta and a MetricRecord:
``num-examples``, ``train-loss``, and, when clipping or when the server sends ``clip-groups``
without budgets (FLConfig ``record_norms``: measured, nothing clipped), the pre-clip
``group-norms``, ``group-clipped``, ``component-norms``, ``component-clipped`` (lists in the
order the server sent), ``joint-norm`` and ``clip-ratio``. The model is reset to the global
parameters after each round, so a cached Brain never carries local state into the next round.

Where each part of a round lives (one job per module):

- :mod:`speechbrain_fl.fl.clientapp.data`: the training DataLoader, made once per ClientTask, its sampler seeded
  afresh every round and client, its collation and the skipping of unreadable audio;
- :mod:`speechbrain_fl.fl.clientapp.optimizer`: the optimiser built once per Brain and reset before every round;
- :mod:`speechbrain_fl.fl.clientapp.local_fit`: the local training itself (:func:`speechbrain_fl.fl.clientapp.local_fit.lean_fit`, the calls
  ``Brain.fit`` makes, or ``brain.fit``) and the recording of ``on_stage_end``'s loss;
- :mod:`speechbrain_fl.fl.clientapp.update`: the round's global tensors decoded once, the delta and the clip
  statistics of the reply;
- this module: :class:`ClientTask`, :func:`train_round` (one message, the steps above in
  order) and :func:`make_client_app` (the ClientApp and its per-process task cache).

Steady-state costs cut here (measured per client message in ``benchmarks/fl_overhead.py``;
the data, optimiser, training and update costs are described in the modules above):

- Seeding: the CPU generator and, if present, CUDA's, not every accelerator backend torch
  knows (``torch.manual_seed`` also seeds XPU, MTIA, MPS: ~1 ms per call for nothing here).
- The reply: its ArrayRecord is written by :func:`speechbrain_fl.fl.npy_codec.encode_record` (Flower's ``.npy``
  bytes, byte for byte, one copy of each tensor, the header and dtype name made once per dtype
  and shape), its MetricRecord and RecordDict by :mod:`speechbrain_fl.fl.clientapp.records` (Flower's records without the
  per-item checks where every value passes them). The clip and the encoding run before the
  model is reset, while the delta is in cache.
- The parameters are listed once per client (:class:`speechbrain_fl.fl.params.ParameterIndex`, rebuilt when
  the module's structure or a ``requires_grad`` changed), for the loads, the delta and the
  optimiser's parameter check; the global tensors are copied into the model in one
  ``torch._foreach_copy_`` call.
- The global tensors are loaded into the model twice a round, and both are needed: before
  training (this round's model) and after it (the reset above, in a ``finally``). Leaving the
  reset to the next round's load would be exact only if that round sent every name this one
  did and nothing read the Brain in between (``ClientTask.partial`` does), and would keep a
  reference to this round's global tensors per cached client until its next round: with
  Poisson sampling, up to one model copy per client. The reset is one copy (~13 us here).

Bit-identical replies for all of these: ``tests/unit/test_fl_client_data.py``, ``test_fl_client_rounds.py``, ``test_fl_speed.py``,
``test_fl_client_collation.py``, ``test_fl_client_reply.py`` (a reply against ``brain.fit`` on
``PaddedBatch`` batches wrapped in Flower's own records: bytes, metrics, object ids),
and ``test_fl_client_clip.py`` (the clip against the
per-tensor arithmetic it replaces).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import speechbrain as sb
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from speechbrain_fl.fl.clientapp.data import _round_sampler_seed, _skipping_collate, _train_loader
from speechbrain_fl.fl.clientapp.local_fit import (
    _local_fit,
    _record_stage_end,
)
from speechbrain_fl.fl.clientapp.optimizer import _reset_optimizer
from speechbrain_fl.fl.clientapp.records import metric_record, reply_record
from speechbrain_fl.fl.clientapp.update import (
    _NORMS_ONLY_JSON,
    _client_metrics,
    _difference,
    _global_tensors,
    _parsed,
)
from speechbrain_fl.fl.npy_codec import encode_record
from speechbrain_fl.fl.params import ParameterIndex, load_trainable
from speechbrain_fl.fl.secagg.train_stage import secure_aggregation_mod
from speechbrain_fl.privacy import Layout, clip_update
from speechbrain_fl.utils.gc_freeze import refreeze

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
        ``accepts_partial`` such as :mod:`speechbrain_fl.fl.aggregate.layerwise`) and adds ``metrics`` (e.g. the
        client's ``exit-depth``) to its MetricRecord.
    lean_fit : bool
        Train with :func:`speechbrain_fl.fl.clientapp.local_fit.lean_fit` (default, our choice) instead of ``brain.fit``:
        the same Brain hooks and arithmetic without ``Brain.fit``'s per-call overhead; a Brain
        that needs ``Brain.fit`` (see :func:`speechbrain_fl.fl.clientapp.local_fit.lean_fit_applies`) gets it either way.
        ``False`` always calls ``brain.fit``.
    fast_collate : bool
        Where ``train_loader_kwargs["collate_fn"]`` is SpeechBrain's ``PaddedBatch`` itself,
        collate with :func:`speechbrain_fl.fl.clientapp.collation.stacked_padded_batch`: the same ``PaddedBatch``, built
        directly where every value is an equal-shape tensor, else
        ``PaddedBatch(examples, padding_func=pad_right_stacked)`` (``apply_default_convert=False``
        where every value is already a tensor). ``False`` keeps the collate function as given.
    """

    brain: sb.Brain
    train_set: Any
    train_loader_kwargs: dict[str, Any] = field(default_factory=dict)
    layout: Layout | None = None
    partial: Callable[[sb.Brain], tuple[Any, dict[str, Any]]] | None = None
    lean_fit: bool = True
    fast_collate: bool = True
    _loader: Any = field(default=None, init=False, repr=False, compare=False)
    _index: ParameterIndex | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if getattr(self.brain, "checkpointer", None) is not None:
            raise ValueError(
                "ClientTask.brain has a checkpointer: Brain.fit would recover it over the "
                "global parameters; build the client Brain with checkpointer=None"
            )


def _seed(seed: int) -> None:
    """Seed the CPU generator (and CUDA's when CUDA is available), as a round's training."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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
    global_params = _global_tensors(content["arrays"])
    if task._index is None:
        task._index = ParameterIndex(task.brain.modules)
    params, parameters = task._index.get()
    load_trainable(task.brain.modules, global_params, own=params)
    reset = [True]  # the model still to be put back to global_params

    def reset_model() -> None:
        if reset[0]:
            reset[0] = False
            # listed again (the index's check): a Brain may freeze or unfreeze during a round
            load_trainable(task.brain.modules, global_params, own=task._index.get()[0])

    try:  # never keep local state between rounds: the model is reset before this returns
        _seed(int(config.get("round-seed", 0)) + int(partition_id))
        epochs = int(config.get("local-epochs", 1))
        # The round's position, for Brains whose schedules span the federated run (e.g. a
        # cosine learning-rate decay over rounds read in ``init_optimizers``).
        task.brain.fl_round = int(config.get("server-round", 1))
        task.brain.fl_num_rounds = int(config.get("num-rounds", 1))
        with _record_stage_end(task.brain) as records, _reset_optimizer(task.brain, parameters):
            loader = _train_loader(task)
            _round_sampler_seed(
                task.brain.train_sampler or getattr(loader, "sampler", None),
                round_seed=int(config.get("round-seed", 0)),
                partition_id=int(partition_id),
            )
            collate = _skipping_collate(loader)
            if collate is not None:
                collate.reset()
            _local_fit(task, loader, epochs)
        with torch.no_grad():
            delta = {n: _difference(params[n], v) for n, v in global_params.items()}
        train_losses = [loss for stage, loss in records if stage == sb.Stage.TRAIN]
        metrics: dict[str, Any] = {
            "num-examples": len(task.train_set),
            "train-loss": train_losses[-1] if train_losses else float("nan"),
        }
        if collate is not None and collate.skipped:
            metrics.update(_unreadable_metrics(collate.skipped, len(task.train_set), partition_id))
        if task.partial is not None:
            reset_model()  # ``partial`` reads the Brain: as reset, as before
            names, extra = task.partial(task.brain)
            names = set(names)
            unknown = sorted(names - set(delta))
            if unknown:
                raise KeyError(
                    f"ClientTask.partial named tensors {unknown[:5]} not in the global model"
                )
            delta = {n: v for n, v in delta.items() if n in names}
            metrics.update(extra)
        # the clip and the encoding read the delta while it is in cache; the reset after them
        if "clip-budgets" in config or "clip-groups" in config:
            # no budgets but groups asked for (a non-DP run recording norms): a bound no
            # update reaches, so the statistics are measured and every tensor is unchanged
            budgets = _parsed(str(config.get("clip-budgets", _NORMS_ONLY_JSON)))
            delta, stats = clip_update(delta, budgets, layout=task.layout, inplace=True)
            metrics.update(
                _client_metrics(
                    stats,
                    _parsed(str(config["clip-groups"])),
                    _parsed(str(config["clip-components"])),
                )
            )
        arrays = encode_record(delta)
    finally:
        reset_model()
    return reply_record(arrays, metric_record(metrics))


def _unreadable_metrics(skipped: dict[str, str], size: int, partition_id: int) -> dict[str, int]:
    """The reply's count of this round's unreadable utterances (``unreadable-utterances``),
    one warning naming them, and an error-level line when none of the client's ``size``
    utterances could be read (``readable-utterances``: 0, its update is zero)."""
    files = sorted(skipped)
    readable = max(0, size - len(files))
    logging.getLogger(__name__).warning(
        "partition %d: %d of %d utterances unreadable and skipped: %s%s",
        partition_id,
        len(files),
        size,
        ", ".join(files[:5]),
        " ..." if len(files) > 5 else "",
    )
    if readable == 0:
        logging.getLogger(__name__).error(
            "partition %d: no readable utterance; its update is zero", partition_id
        )
    return {"unreadable-utterances": len(files), "readable-utterances": readable}


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
    # SecAgg+ rounds (the server's ``secure_aggregation``) go through Flower's mod; others not
    app = ClientApp(mods=[secure_aggregation_mod])
    shared_key = getattr(build_client, "cache_key", None)
    own_cache: OrderedDict[Any, ClientTask] = OrderedDict()
    evictions = [0]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        partition_id = int(context.node_config.get("partition-id", 0))
        key = (shared_key, context.run_id, partition_id)
        # _process_cache is found by name in the worker (pickled by reference), so it is the
        # worker's own dict; a dict captured here would be pickled along with the app.
        cache = _process_cache() if shared_key is not None else own_cache
        built = key not in cache
        if built:
            while len(cache) >= max(1, cache_size):
                cache.popitem(last=False)
                evictions[0] += 1
            cache[key] = build_client(context)
        cache.move_to_end(key)
        content = train_round(cache[key], msg.content, partition_id=partition_id)
        if built and not evictions[0]:
            # kept to the run's end: out of the collector's full scans inside the local
            # backend's frozen_heap (nothing outside it); never once a client was evicted
            refreeze()
        content["metrics"]["partition-id"] = partition_id
        return Message(content=content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        partition_id = int(context.node_config.get("partition-id", 0))
        metrics = MetricRecord({"partition-id": partition_id})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app

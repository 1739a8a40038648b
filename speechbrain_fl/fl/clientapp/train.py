"""One client round, in one module: the ClientApp's train handler on SpeechBrain's ``Brain``.

:func:`train_round` is the round, in order: load the global *trainable* tensors into the Brain
(the names in the message's ArrayRecord), seed torch with the round seed plus the partition id,
train ``local-epochs`` epochs with ``brain.fit`` on the client's DataLoader, read the loss the
Brain passes to ``on_stage_end``, compute delta = local - global, clip it with the budgets of
the round's ConfigRecord (:func:`speechbrain_fl.privacy.clip_update`; with ``clip-groups`` and no
budgets the norms are only measured) and reply with Flower's records: the delta and
``num-examples``, ``train-loss`` and the clip statistics (under adaptive clipping also
``clip-bits``, one bit ``[pre-clip pool norm <= C_p]`` per pool of ``clip-quantile-pools``). The model is put back to the global
tensors before the function returns, so a cached Brain carries no local state across rounds.

The recipe's ``build_client(context) -> ClientTask`` is called once per partition and process
(:func:`make_client_app` caches the task in a module-level dict: Flower's Simulation Engine
pickles the ClientApp with every message). The DataLoader is made once per task; its shuffling
sampler gets a seed mixed from the round seed and the partition id every round.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import speechbrain as sb
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from speechbrain.dataio.batch import PaddedBatch
from speechbrain.dataio.dataset import DynamicItemDataset

from speechbrain_fl.data.audio_check import EMPTY_BATCH, SkippingCollate
from speechbrain_fl.fl.clientapp.collation import TensorRows
from speechbrain_fl.fl.clientapp.collation import stacked_padded_batch as _stacked_padded_batch
from speechbrain_fl.fl.npy_codec import decode_record, encode_record
from speechbrain_fl.fl.params import ParameterIndex, load_trainable
from speechbrain_fl.fl.secagg.train_stage import secure_aggregation_mod
from speechbrain_fl.privacy import Layout, clip_update
from speechbrain_fl.privacy.adaptive_clipping import clip_bits
from speechbrain_fl.utils.gc_freeze import refreeze

__all__ = ["NORMS_ONLY_BUDGET", "ClientTask", "make_client_app", "train_round"]

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


def _train_loader(task: Any) -> Any:
    """The training DataLoader of ``task`` (a ClientTask), made once (see the module docstring).

    ``brain.make_dataloader`` also sets ``brain.train_sampler`` (the sampler ``Brain.fit``
    calls ``set_epoch`` on); it is put back before every round, as a fresh loader would set it.
    """
    if isinstance(task.train_set, torch.utils.data.DataLoader) or hasattr(
        task.train_set, "__next__"
    ):
        return task.train_set  # the recipe's own loader (or a LoopedLoader)
    if task._loader is None:
        kwargs = dict(task.train_loader_kwargs)
        if task.fast_collate and kwargs.get("collate_fn") is PaddedBatch:
            kwargs["collate_fn"] = _stacked_padded_batch
        collate = kwargs.get("collate_fn")
        if collate is None and isinstance(task.train_set, DynamicItemDataset):
            collate = PaddedBatch  # what make_dataloader gives such a dataset
        if collate is not None:  # an unreadable example is dropped, not the client's round
            kwargs["collate_fn"] = SkippingCollate(collate, trusted=(TensorRows,))
        loader = task.brain.make_dataloader(task.train_set, stage=sb.Stage.TRAIN, **kwargs)
        task._loader = (loader, task.brain.train_sampler)
    loader, task.brain.train_sampler = task._loader
    return loader


#: The seed attribute of a sampler that shuffles with ``seed + epoch``: SpeechBrain's
#: ``ReproducibleRandomSampler`` (``seed``) and ``DynamicBatchSampler`` (``_seed``).
_SEED_ATTRIBUTES = ("seed", "_seed")


def _round_sampler_seed(sampler: Any, *, round_seed: int, partition_id: int) -> None:
    """Give a ``seed + epoch`` sampler this round's and this client's seed.

    SpeechBrain's shuffling samplers draw epoch ``e``'s order from ``seed + e``, and a round
    runs epochs ``1..E``: with one seed, a client would see the same orders every round and
    clients with as many examples the same permutation. The sampler's seed for a round is
    ``SeedSequence([s0, round_seed, partition_id])``'s first 32-bit word, ``s0`` the seed it
    was built with: a new order every round and client, the same for the same run seed (the
    server draws ``round_seed`` from it). A sampler without such a seed (torch's
    ``RandomSampler``, drawing from the torch generator the round reseeds) is left as is.
    """
    if sampler is None or not hasattr(sampler, "set_epoch"):
        return
    name = next((a for a in _SEED_ATTRIBUTES if isinstance(getattr(sampler, a, None), int)), None)
    if name is None:
        return
    base = sampler.__dict__.setdefault("_fl_base_seed", getattr(sampler, name))
    entropy = [base % 2**32, round_seed % 2**32, partition_id]
    setattr(sampler, name, int(np.random.SeedSequence(entropy).generate_state(1)[0]))


def _skipping_collate(loader: Any) -> SkippingCollate | None:
    """The loader's :class:`SkippingCollate` (:func:`_train_loader`'s), else ``None``."""
    collate = getattr(loader, "collate_fn", None)
    return collate if isinstance(collate, SkippingCollate) else None


# The last round's decoded global tensors: (names, the Arrays' bytes objects, tensors).
_DECODED: list[Any] = []


def _global_tensors(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()`` (:func:`speechbrain_fl.fl.npy_codec.decode_record`: the same tensors,
    without ``np.load``'s header parsing), decoded once per distinct payload (read-only)."""
    names = tuple(arrays.keys())
    payload = tuple(a.data for a in arrays.values())
    if (
        _DECODED
        and _DECODED[0] == names
        and all(x is y for x, y in zip(_DECODED[1], payload, strict=True))
    ):
        return _DECODED[2]
    tensors = decode_record(arrays)
    _DECODED[:] = [names, payload, tensors]  # keeps the bytes alive, so their ids stay unique
    return tensors


def _difference(param: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``param - start`` in float32 on the CPU: one new tensor (the reply's), no other copy.

    ``param.detach().cpu().to(float32) - start.to(float32)``, whose conversions return their
    input when ``param`` already is a float32 CPU tensor (the subtraction is then done
    directly; under ``torch.no_grad`` no graph is recorded either way).
    """
    if param.dtype is torch.float32 and start.dtype is torch.float32 and param.device.type == "cpu":
        return torch.sub(param, start)
    return param.detach().cpu().to(torch.float32) - start.to(torch.float32)


#: The bound used when the server asks for group norms without clipping (``clip-groups`` and
#: no ``clip-budgets``): no finite update reaches it, so nothing is clipped.
NORMS_ONLY_BUDGET = 1e300


_NORMS_ONLY_JSON = json.dumps(NORMS_ONLY_BUDGET)


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> Any:
    """``json.loads(text)``, parsed once per distinct string: the clip budgets, groups and
    components a server sends are the same string round after round (and for every client of
    a round). The result is shared: read it, never modify it (``clip_update`` and
    :func:`_client_metrics` only read)."""
    return json.loads(text)


def _client_metrics(stats: Any, groups: list[str], comps: list[str]) -> dict[str, Any]:
    """The reply's clip statistics from ``clip_update``'s ``stats``: per group and component
    (in the server's order ``groups``, ``comps``) the pre-clip norm and whether it was
    clipped, the joint norm and the clip ratio."""
    return {
        "group-norms": [float(stats.group_norms.get(g, 0.0)) for g in groups],
        "group-clipped": [float(bool(stats.clipped.get(g, False))) for g in groups],
        "component-norms": [float(stats.component_norms.get(c, 0.0)) for c in comps],
        "component-clipped": [float(bool(stats.component_clipped.get(c, False))) for c in comps],
        "joint-norm": float(stats.joint_norm),
        "clip-ratio": float(stats.clip_ratio),
    }


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


def _local_fit(brain: sb.Brain, train_loader: Any, epochs: int) -> None:
    """``brain.fit`` for the round's local epochs, with a ``fit_batch`` that makes no step on a
    batch whose every example was unreadable (``EMPTY_BATCH``), for this call only."""
    fit_batch = brain.fit_batch

    def skipping_fit_batch(batch):
        if batch is EMPTY_BATCH:
            return torch.zeros(())
        return fit_batch(batch)

    own = brain.__dict__.get("fit_batch")
    brain.fit_batch = skipping_fit_batch
    try:
        brain.fit(range(1, epochs + 1), train_loader, progressbar=False)
    finally:
        if own is None:
            del brain.fit_batch  # back to the class method
        else:
            brain.fit_batch = own


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
    params = task._index.get()[0]
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
        with _record_stage_end(task.brain) as records:
            loader = _train_loader(task)
            _round_sampler_seed(
                task.brain.train_sampler or getattr(loader, "sampler", None),
                round_seed=int(config.get("round-seed", 0)),
                partition_id=int(partition_id),
            )
            collate = _skipping_collate(loader)
            if collate is not None:
                collate.reset()
            _local_fit(task.brain, loader, epochs)
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
            if "clip-quantile-pools" in config:  # adaptive clipping: [pool norm <= C_p] per pool
                metrics["clip-bits"] = clip_bits(
                    stats.component_norms, _parsed(str(config["clip-quantile-pools"]))
                )
        arrays = encode_record(delta)
    finally:
        reset_model()
    return RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)})


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

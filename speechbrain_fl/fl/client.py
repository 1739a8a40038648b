"""ClientApp factory: a SpeechBrain ``Brain`` trained locally (``Brain.fit``'s calls, see
:func:`lean_fit`).

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
``local-epochs`` epochs (:func:`lean_fit`, or ``brain.fit`` where that does not apply), read
the loss the Brain passes to ``on_stage_end`` (recorded by a wrapper around the instance's
hook, so neither the Brain's class nor its hooks are changed), compute
delta = local - global, clip it with the budgets from the ConfigRecord
(:func:`speechbrain_fl.privacy.clip_update`) and reply with the clipped delta and a MetricRecord:
``num-examples``, ``train-loss``, and, when clipping or when the server sends ``clip-groups``
without budgets (FLConfig ``record_norms``: measured, nothing clipped), the pre-clip ``group-norms``,
``group-clipped``, ``component-norms``, ``component-clipped`` (lists in the order the server
sent), ``joint-norm`` and ``clip-ratio``. The model is reset to the global parameters after each
round, so a cached Brain never carries local state into the next round.

Steady-state costs cut here (measured per client message in ``benchmarks/fl_overhead.py``):

- The training DataLoader is made once per ClientTask (``brain.make_dataloader``, exactly what
  ``Brain.fit`` would make each round) and passed to ``brain.fit``. Its order is fresh every
  round and client: SpeechBrain's shuffling sampler (``seed + epoch``) gets a seed mixed from
  its own, the round seed and the partition id (:func:`_round_sampler_seed`), then is set per
  epoch (``set_epoch``); other samplers draw from the torch RNG, which each round reseeds.
- The optimiser is made once per Brain and *reset* before every round instead of rebuilt:
  its per-parameter state (momenta, Adam moments, step counts) is cleared and its param
  groups' hyperparameters are put back to the values it was built with, so round r+1 starts
  from the same optimiser as a freshly built one and no local state crosses rounds
  (``tests/unit/test_fl_speed.py``). Only a Brain that keeps SpeechBrain's own
  ``init_optimizers`` (one optimiser over ``brain.modules.parameters()``) is treated so; a
  Brain that overrides it (e.g. a learning rate that follows the federated round) gets its
  own ``init_optimizers`` every round, as before.
- The global tensors of a round are decoded from the message once per process and shared by
  the clients of the round that receive the same arrays (the local backend's messages share
  them; a Ray actor's unpickled messages do not, and decode as before). They are read-only.
- Local training makes the calls ``Brain.fit`` makes on the Brain for a training-only round,
  without ``Brain.fit``'s per-call extras (:func:`lean_fit`; bit-identical updates).
- Seeding: the CPU generator and, if present, CUDA's, not every accelerator backend torch
  knows (``torch.manual_seed`` also seeds XPU, MTIA, MPS: ~1 ms per call for nothing here).
- Collation: a loader whose ``collate_fn`` is SpeechBrain's ``PaddedBatch`` itself gets
  :func:`.collation.stacked_padded_batch`: the same ``PaddedBatch``, built attribute by
  attribute where every value is an equal-shape tensor (one ``torch.stack`` per key), with
  ``pad_right_stacked`` padding otherwise (the same batches, tested field by field;
  ``ClientTask.fast_collate=False`` keeps the collate function as given). The toy dataset
  serves a batch with torch's ``__getitems__`` as a :class:`.collation.TensorRows` list, so
  the per-value check is decided once, by the dataset.
- One pass over the loader per epoch without torch's iterator object where its
  single-process iterator does exactly the same calls (:func:`.collation.epoch_batches`: the
  batch sampler's indices, the iterator's base-seed draw, ``__getitems__`` and the collate
  function; the same batches and random draws, tested against the DataLoader), without its
  construction and its profiler scope per batch; any other loader is iterated as is.
- The reply: its ArrayRecord is written by :func:`.npy_codec.encode_record` (Flower's ``.npy``
  bytes, byte for byte, one copy of each tensor, the header and dtype name made once per dtype
  and shape), its MetricRecord and RecordDict by :mod:`.records` (Flower's records without the
  per-item checks where every value passes them). The clip and the encoding run before the
  model is reset, while the delta is in cache.
- No per-step work a setting switches off: with ``max_grad_norm: inf`` (SpeechBrain's per-step
  gradient clipping off) ``Brain.optimizers_step`` runs without its ``clip_grad_norm_``, which
  SpeechBrain 1.1 calls every step whatever the bound (a norm over every gradient, then a
  multiplication by 1.0): :func:`_unclipped_optimizers_step`, the same steps otherwise.
- The training step in fp32: a Brain that keeps SpeechBrain's ``fit_batch`` and
  ``optimizers_step`` (fp32, no gradient accumulation, no DDP) is stepped by
  :func:`.lean_step.lean_fit_batch`: SpeechBrain 1.1's calls without the no-op ``no_sync``,
  autocast and disabled-scaler calls, the loss's finiteness read once a step (for
  ``check_loss_isfinite`` and the running average); any other Brain gets its ``fit_batch``.
  The per-epoch ``zero_grad`` is left out where no optimised parameter has a gradient.
- ``modules.train()`` is left out where every submodule is already in training mode and keeps
  ``torch.nn.Module.train`` (it would only set ``training = True`` again).
- The parameters are listed once per client (:class:`.params.ParameterIndex`, rebuilt when
  the module's structure or a ``requires_grad`` changed), for the loads, the delta and the
  optimiser's parameter check; the optimiser's hyperparameters are restored without deep
  copies of immutable values (:func:`_restore_groups`); the delta is one subtraction; the
  global tensors are copied into the model in one ``torch._foreach_copy_`` call.
- The global tensors are loaded into the model twice a round, and both are needed: before
  training (this round's model) and after it (the reset above, in a ``finally``). Leaving the
  reset to the next round's load would be exact only if that round sent every name this one
  did and nothing read the Brain in between (``ClientTask.partial`` does), and would keep a
  reference to this round's global tensors per cached client until its next round: with
  Poisson sampling, up to one model copy per client. The reset is one copy (~13 us here).

Bit-identical replies for all of these: ``tests/unit/test_fl_client_lean_step.py``,
``test_fl_client_data.py``, ``test_fl_client_rounds.py``, ``test_fl_speed.py``,
``test_fl_client_collation.py``, ``test_fl_client_reply.py`` (a reply against ``brain.fit`` on
``PaddedBatch`` batches wrapped in Flower's own records: bytes, metrics, object ids),
``test_fl_client_epoch_batches.py`` (batches and random draws against torch's iterator),
``test_fl_client_optimizer_step.py`` and ``test_fl_client_clip.py`` (the clip against the
per-tensor arithmetic it replaces).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
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
from speechbrain.dataio.dataloader import LoopedLoader
from speechbrain.dataio.dataset import DynamicItemDataset

from speechbrain_fl.privacy import Layout, clip_update

from ..data.audio_check import EMPTY_BATCH, SkippingCollate
from ..utils.gc_freeze import refreeze
from .collation import TensorRows, epoch_batches, pad_right_stacked
from .collation import stacked_padded_batch as _stacked_padded_batch
from .lean_step import is_speechbrains_method, lean_fit_batch, lean_fit_batch_applies
from .npy_codec import decode_record, encode_record
from .params import ParameterIndex, load_trainable
from .records import metric_record, reply_record
from .secure_aggregation import secure_aggregation_mod

__all__ = ["ClientTask", "make_client_app", "pad_right_stacked", "train_round"]

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
    lean_fit : bool
        Train with :func:`lean_fit` (default, our choice) instead of ``brain.fit``: the same
        Brain hooks and arithmetic without ``Brain.fit``'s per-call overhead; a Brain that
        needs ``Brain.fit`` (see :func:`lean_fit_applies`) gets it either way; its steps are
        :func:`.lean_step.lean_fit_batch` where :func:`.lean_step.lean_fit_batch_applies`,
        the Brain's ``fit_batch`` otherwise. ``False`` always calls ``brain.fit`` (with
        SpeechBrain's ``fit_batch``).
    fast_collate : bool
        Where ``train_loader_kwargs["collate_fn"]`` is SpeechBrain's ``PaddedBatch`` itself,
        collate with :func:`.collation.stacked_padded_batch`: the same ``PaddedBatch``, built
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


def _train_loader(task: ClientTask) -> Any:
    """The task's training DataLoader, made once (see the module docstring).

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


def _immutable(value: Any) -> bool:
    """Whether ``value`` is a number, string, None or a tuple of those (safe to share)."""
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return value is None or type(value) in (bool, int, float, complex, str)


def _restore_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Put the param groups' hyperparameters back to ``groups`` (as recorded at build time).

    ``group.update(copy.deepcopy(initial))`` without the copy where none is needed: a value
    that is still the recorded object is left, an immutable one (a number, string, None, a
    tuple of those) is assigned as is, any other (a tensor learning rate, a list) is a fresh
    deep copy, so the record is never shared with the optimiser. Keys added during a round
    stay, as ``update`` leaves them.
    """
    for group, initial in zip(optimizer.param_groups, groups, strict=True):
        for key, value in initial.items():
            if group.get(key, _immutable) is value and _immutable(value):
                continue
            group[key] = value if _immutable(value) else copy.deepcopy(value)


@contextlib.contextmanager
def _reset_optimizer(
    brain: sb.Brain, parameters: list[torch.nn.Parameter] | None = None
) -> Iterator[None]:
    """Reuse ``brain``'s optimiser across rounds, reset to its freshly built state.

    ``Brain.on_fit_start`` calls ``init_optimizers``; for a Brain with SpeechBrain's own
    ``init_optimizers`` the first call builds the optimiser as usual and records its param
    groups' hyperparameters; later calls clear its state and restore those hyperparameters
    (:func:`_restore_groups`: a freshly built optimiser, without building one), as long as
    ``brain.modules.parameters()`` are the same tensors (``parameters``, when the caller has
    listed them, e.g. a :class:`.params.ParameterIndex`). Another ``init_optimizers`` runs as is.
    """
    if type(brain).init_optimizers is not sb.Brain.init_optimizers or brain.opt_class is None:
        yield
        return
    if parameters is None:
        parameters = list(brain.modules.parameters())
    params = [id(p) for p in parameters]

    def init_optimizers() -> None:
        saved = brain.__dict__.get("_sbfl_optimizer")
        if (
            saved is not None
            and saved[0] is getattr(brain, "optimizer", None)
            and saved[1] == params
        ):
            optimizer, _, groups, _ = saved
            optimizer.state.clear()
            _restore_groups(optimizer, groups)
            brain.optimizers_dict = {"opt_class": optimizer}
            return
        sb.Brain.init_optimizers(brain)
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in brain.optimizer.param_groups
        ]
        # the parameters are held, so their ids in ``params`` stay theirs
        brain._sbfl_optimizer = (brain.optimizer, params, copy.deepcopy(groups), parameters)

    brain.init_optimizers = init_optimizers
    try:
        yield
    finally:
        del brain.init_optimizers  # back to the class method


def _unclipped_optimizers_step(brain: sb.Brain) -> None:
    """SpeechBrain 1.1's ``Brain.optimizers_step`` without its step 3, the per-step
    ``clip_grad_norm_(params, max_grad_norm)``, for ``max_grad_norm = inf``.

    With an infinite bound that call computes the gradients' global L2 norm ``||g||`` and
    multiplies every gradient by ``min(1, inf / (||g|| + 1e-6)) = 1.0``: nothing, at the cost
    of a pass over every gradient each step (~2 ms of ~10 ms a client round in
    ``benchmarks/fl_overhead.py``). Steps 1, 2 and 4 (the optimisers ``freeze_optimizers``
    leaves, the AMP scaler's unscale, SpeechBrain's non-finite check when
    ``skip_nonfinite_grads``, the scaler's step and update, ``zero_grad(set_to_none=True)``,
    ``optimizer_step += 1``) are SpeechBrain's, in its order, so for finite gradients the update
    is bit-identical (``tests/unit/test_fl_client_step.py``). A non-finite gradient differs:
    SpeechBrain's ``clip_grad_norm_`` with an infinite bound multiplies every gradient by
    ``inf / inf = nan``, this leaves the finite ones as they are; the update is non-finite
    either way, and the server drops a non-finite reply.
    """
    if brain.optimizers_dict is not None:
        valid_optimizers = brain.freeze_optimizers(brain.optimizers_dict)
    elif brain.opt_class is not None:
        valid_optimizers = {"optimizer": brain.optimizer}
    else:
        return
    for opt in valid_optimizers.values():
        brain.scaler.unscale_(opt)
    if not brain.scaler.is_enabled() and brain.skip_nonfinite_grads:
        brain.check_gradients()
    for opt in valid_optimizers.values():
        brain.scaler.step(opt)
    brain.scaler.update()
    for opt in valid_optimizers.values():
        opt.zero_grad(set_to_none=True)
    brain.optimizer_step += 1


#: SpeechBrain releases whose ``Brain.optimizers_step`` :func:`_unclipped_optimizers_step`
#: reproduces (read from speechbrain/core.py of 1.1.x); another release keeps its own.
_OPTIMIZERS_STEP_RELEASES = ("1.1.",)


@contextlib.contextmanager
def _skip_disabled_clipping(brain: sb.Brain) -> Iterator[None]:
    """Use :func:`_unclipped_optimizers_step` for this round when it applies.

    It applies to a Brain that keeps SpeechBrain's ``optimizers_step`` and
    ``freeze_optimizers``-based flow (the class attribute is ``sb.Brain``'s), has
    ``max_grad_norm == inf``, and runs on a SpeechBrain release in
    :data:`_OPTIMIZERS_STEP_RELEASES`; otherwise the Brain's own method runs unchanged.
    """
    applies = (
        type(brain).optimizers_step is sb.Brain.optimizers_step
        and "optimizers_step" not in brain.__dict__
        and math.isinf(float(getattr(brain, "max_grad_norm", 0.0)))
        and float(brain.max_grad_norm) > 0
        and sb.__version__.startswith(_OPTIMIZERS_STEP_RELEASES)
    )
    if not applies:
        yield
        return
    brain.optimizers_step = functools.partial(_unclipped_optimizers_step, brain)
    try:
        yield
    finally:
        del brain.optimizers_step  # back to the class method


#: Brain methods the lean loop stands in for: a Brain overriding any of them gets ``fit``.
_FIT_METHODS = ("fit", "_fit_train", "_fit_valid", "on_fit_start")


def lean_fit_applies(brain: sb.Brain) -> bool:
    """Whether :func:`lean_fit` does exactly what ``brain.fit`` would for a client round.

    True for a Brain that keeps SpeechBrain's ``fit``, ``_fit_train``, ``_fit_valid`` and
    ``on_fit_start`` and asks for none of what ``on_fit_start`` or the training loop adds per
    call: no checkpointer (a :class:`ClientTask` has none), no ``torch.compile``/JIT, no DDP or
    DataParallel wrapping, no profiler, not ``test_only``.

    Example
    -------
    >>> from speechbrain_fl.fl.toy import toy_client, toy_settings
    >>> from flwr.app import Context, RecordDict
    >>> ctx = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    >>> lean_fit_applies(toy_client(ctx, toy_settings()).brain)
    True
    """
    cls = type(brain)
    return (
        all(getattr(cls, m) is getattr(sb.Brain, m) for m in _FIT_METHODS)
        and getattr(brain, "checkpointer", None) is None
        and not getattr(brain, "compile", False)
        and not getattr(brain, "jit", False)
        and not getattr(brain, "distributed_launch", False)
        and not getattr(brain, "data_parallel_backend", False)
        and getattr(brain, "profiler", None) is None
        and not getattr(brain, "test_only", False)
    )


def lean_fit(brain: sb.Brain, train_loader: Any, epochs: int, *, lean_step: bool = False) -> None:
    """``brain.fit(range(1, epochs + 1), train_loader, progressbar=False)`` without its
    per-call overhead, for a Brain where :func:`lean_fit_applies`.

    ``Brain.fit`` (SpeechBrain 1.x ``speechbrain/core.py``) does, per call: ``on_fit_start``
    (``_compile`` and ``_wrap_distributed``, no-ops here; ``init_optimizers``; checkpoint
    recovery, none here), then per epoch ``_fit_train``: ``on_stage_start(TRAIN, epoch)``,
    ``modules.train()``, ``zero_grad()``, the sampler's ``set_epoch(epoch)``, a tqdm object
    around the loader (disabled, but it still formats the running loss into a postfix string
    every step), per batch ``step += 1``, ``fit_batch(batch)``, ``update_average``, then
    ``zero_grad(set_to_none=True)``, ``on_stage_end(TRAIN, avg_loss, epoch)``. This function
    makes the same calls on the Brain in the same order, so the Brain's own ``fit_batch``,
    ``on_stage_start``, ``on_stage_end``, ``init_optimizers``, ``on_fit_batch_start/end`` and
    ``optimizers_step`` (with SpeechBrain's per-step ``clip_grad_norm_`` to ``max_grad_norm``)
    run unchanged and the update is bit-identical (``tests/unit/test_fl_speed.py``); it leaves
    out the tqdm object and its postfix, the profiler, intra-epoch checkpoints (no
    checkpointer) and the validation stage (a client has no validation set). SpeechBrain's
    ``debug`` limits and ``optimizer_step_limit`` are kept.

    Arguments
    ---------
    brain : speechbrain.Brain
        A Brain for which :func:`lean_fit_applies`.
    train_loader : DataLoader
        The client's training loader (not a Dataset).
    epochs : int
        Local epochs (1, 2, ..., ``epochs``).
    lean_step : bool
        Train each batch with :func:`.lean_step.lean_fit_batch` instead of
        ``brain.fit_batch`` (the caller checked :func:`.lean_step.lean_fit_batch_applies`
        before anything was put in the Brain's ``__dict__``). With SpeechBrain's
        ``update_average``, the running loss is then its arithmetic on the step's
        ``loss.item()`` (one finiteness check a step instead of two).
    """
    brain.init_optimizers()  # on_fit_start with no compile, wrapping or checkpointer
    own_average = not is_speechbrains_method(brain, "update_average")
    for epoch in range(1, epochs + 1):
        brain.on_stage_start(sb.Stage.TRAIN, epoch)
        if not _in_train_mode(brain.modules):
            brain.modules.train()
        _zero_grad(brain, set_to_none=False)
        brain.nonfinite_count = 0
        sampler = brain.train_sampler
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in epoch_batches(train_loader):
            if brain._optimizer_step_limit_exceeded:
                break
            if batch is EMPTY_BATCH:  # every example unreadable: nothing to train on
                continue
            brain.step += 1
            if not lean_step:
                loss = brain.fit_batch(batch)
                brain.avg_train_loss = brain.update_average(loss, brain.avg_train_loss)
            elif own_average:
                loss, _ = lean_fit_batch(brain, batch)
                brain.avg_train_loss = brain.update_average(loss, brain.avg_train_loss)
            else:  # SpeechBrain's update_average on float(loss), its finiteness read once
                _, value = lean_fit_batch(brain, batch)
                if math.isfinite(value):
                    avg = brain.avg_train_loss
                    avg -= avg / brain.step
                    avg += value / brain.step
                    brain.avg_train_loss = avg
            if brain.debug and brain.step == brain.debug_batches:
                break
        _zero_grad(brain, set_to_none=True)
        brain.on_stage_end(sb.Stage.TRAIN, brain.avg_train_loss, epoch)
        brain.avg_train_loss = 0.0
        brain.step = 0
        if (brain.debug and epoch == brain.debug_epochs) or brain._optimizer_step_limit_exceeded:
            break


def _in_train_mode(modules: torch.nn.Module) -> bool:
    """Whether ``modules.train()`` would change nothing: every submodule is in training mode
    and keeps ``torch.nn.Module.train`` (which only sets ``training = True`` down the tree);
    a module with its own ``train`` (e.g. one keeping a frozen part in eval) gets the call."""
    train = torch.nn.Module.train
    for module in modules.modules():
        if not module.training or type(module).train is not train:
            return False
    return True


def _zero_grad(brain: sb.Brain, *, set_to_none: bool) -> None:
    """``brain.zero_grad(set_to_none)``, left out where it does nothing: SpeechBrain's
    ``zero_grad`` and ``freeze_optimizers`` and no gradient on any optimised parameter (after
    ``zero_grad(set_to_none=True)`` of the last step, or before the first backward)."""
    if is_speechbrains_method(brain, "zero_grad") and is_speechbrains_method(
        brain, "freeze_optimizers"
    ):
        if brain.optimizers_dict is not None:
            optimizers = list(brain.optimizers_dict.values())
        elif brain.opt_class is not None:
            optimizers = [brain.optimizer]
        else:
            return
        if all(p.grad is None for o in optimizers for g in o.param_groups for p in g["params"]):
            return
    brain.zero_grad(set_to_none=set_to_none)


def _local_fit(
    task: ClientTask, train_loader: Any, epochs: int, *, lean_step: bool = False
) -> None:
    """One round's local training: :func:`lean_fit` where it applies (a DataLoader or
    LoopedLoader, which ``Brain.fit`` would use as is), else ``brain.fit``; with ``lean_step``
    (checked by the caller: :func:`.lean_step.lean_fit_batch_applies`) the steps are
    :func:`.lean_step.lean_fit_batch` in both (for ``brain.fit``, as the Brain's ``fit_batch``
    for this call only, so a Brain with its own ``on_fit_start``, e.g. SUPERB's, steps lean)."""
    brain = task.brain
    if (
        task.lean_fit
        and isinstance(train_loader, (torch.utils.data.DataLoader, LoopedLoader))
        and lean_fit_applies(brain)
    ):
        lean_fit(brain, train_loader, epochs, lean_step=lean_step)
        return
    if not lean_step:
        fit_batch = brain.fit_batch
    else:

        def fit_batch(batch):
            return lean_fit_batch(brain, batch)[0]

    def skipping_fit_batch(batch):
        if batch is EMPTY_BATCH:  # every example unreadable: no step, a zero loss
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


# The last round's decoded global tensors: (names, the Arrays' bytes objects, tensors).
_DECODED: list[Any] = []


def _global_tensors(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()`` (:func:`.npy_codec.decode_record`: the same tensors,
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


def _seed(seed: int) -> None:
    """Seed the CPU generator (and CUDA's when CUDA is available), as a round's training."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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
        # checked before the contexts below put methods in the Brain's __dict__
        lean_step = task.lean_fit and lean_fit_batch_applies(task.brain)
        with (
            _record_stage_end(task.brain) as records,
            _reset_optimizer(task.brain, parameters),
            _skip_disabled_clipping(task.brain),
        ):
            loader = _train_loader(task)
            _round_sampler_seed(
                task.brain.train_sampler or getattr(loader, "sampler", None),
                round_seed=int(config.get("round-seed", 0)),
                partition_id=int(partition_id),
            )
            collate = _skipping_collate(loader)
            if collate is not None:
                collate.reset()
            _local_fit(task, loader, epochs, lean_step=lean_step)
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

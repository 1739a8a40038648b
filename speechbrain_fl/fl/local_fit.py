"""One round's local training: the calls SpeechBrain's ``Brain.fit`` makes, without its extras.

Used by :func:`speechbrain_fl.fl.client.train_round`, which trains ``local-epochs`` epochs with
:func:`_local_fit`: :func:`lean_fit`, or ``brain.fit`` where that does not apply, and reads the
loss the Brain passes to ``on_stage_end`` (recorded by :func:`_record_stage_end`, a wrapper
around the instance's hook, so neither the Brain's class nor its hooks are changed). The task
:func:`_local_fit` takes is a :class:`~speechbrain_fl.fl.client.ClientTask`, typed ``Any`` here
(:mod:`.client` imports this module; importing ``ClientTask`` back would make an import loop).

- Local training makes the calls ``Brain.fit`` makes on the Brain for a training-only round,
  without ``Brain.fit``'s per-call extras (:func:`lean_fit`; bit-identical updates).
- The training step in fp32: a Brain that keeps SpeechBrain's ``fit_batch`` and
  ``optimizers_step`` (fp32, no gradient accumulation, no DDP) is stepped by
  :func:`.lean_step.lean_fit_batch`: SpeechBrain 1.1's calls without the no-op ``no_sync``,
  autocast and disabled-scaler calls, the loss's finiteness read once a step (for
  ``check_loss_isfinite`` and the running average); any other Brain gets its ``fit_batch``.
  The per-epoch ``zero_grad`` is left out where no optimised parameter has a gradient.
- One pass over the loader per epoch without torch's iterator object where its
  single-process iterator does exactly the same calls (:func:`.collation.epoch_batches`: the
  batch sampler's indices, the iterator's base-seed draw, ``__getitems__`` and the collate
  function; the same batches and random draws, tested against the DataLoader), without its
  construction and its profiler scope per batch; any other loader is iterated as is.
- ``modules.train()`` is left out where every submodule is already in training mode and keeps
  ``torch.nn.Module.train`` (it would only set ``training = True`` again).
- A batch whose every example was unreadable (``EMPTY_BATCH``) is no step.

Bit-identical updates: ``tests/unit/test_fl_speed.py``, ``test_fl_client_lean_step.py``,
``test_fl_client_epoch_batches.py`` (batches and random draws against torch's iterator).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import speechbrain as sb
import torch
from speechbrain.dataio.dataloader import LoopedLoader

from ..data.audio_check import EMPTY_BATCH
from .collation import epoch_batches
from .lean_step import is_speechbrains_method, lean_fit_batch

__all__ = ["lean_fit", "lean_fit_applies"]


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


#: Brain methods the lean loop stands in for: a Brain overriding any of them gets ``fit``.
_FIT_METHODS = ("fit", "_fit_train", "_fit_valid", "on_fit_start")


def lean_fit_applies(brain: sb.Brain) -> bool:
    """Whether :func:`lean_fit` does exactly what ``brain.fit`` would for a client round.

    True for a Brain that keeps SpeechBrain's ``fit``, ``_fit_train``, ``_fit_valid`` and
    ``on_fit_start`` and asks for none of what ``on_fit_start`` or the training loop adds per
    call: no checkpointer (a :class:`~.client.ClientTask` has none), no ``torch.compile``/JIT,
    no DDP or DataParallel wrapping, no profiler, not ``test_only``.

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


def _local_fit(task: Any, train_loader: Any, epochs: int, *, lean_step: bool = False) -> None:
    """One round's local training of ``task`` (a ClientTask): :func:`lean_fit` where it applies
    (a DataLoader or LoopedLoader, which ``Brain.fit`` would use as is), else ``brain.fit``;
    with ``lean_step`` (checked by the caller: :func:`.lean_step.lean_fit_batch_applies`) the
    steps are :func:`.lean_step.lean_fit_batch` in both (for ``brain.fit``, as the Brain's
    ``fit_batch`` for this call only, so a Brain with its own ``on_fit_start``, e.g. SUPERB's,
    steps lean)."""
    brain = task.brain
    if (
        task.lean_fit
        and isinstance(train_loader, torch.utils.data.DataLoader | LoopedLoader)
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

"""One round's local training: the calls SpeechBrain's ``Brain.fit`` makes, without its extras.

:func:`speechbrain_fl.fl.clientapp.train.train_round` trains ``local-epochs`` epochs with
:func:`_local_fit`: :func:`lean_fit` where it applies, else ``brain.fit``. Either way the
Brain's own ``fit_batch`` trains each batch, and the loss it passes to ``on_stage_end`` is read
by :func:`_record_stage_end` (a wrapper around the instance's hook). :func:`lean_fit` leaves out
``Brain.fit``'s per-call extras (tqdm, profiler, checkpoints, validation); the update is
bit-identical (``tests/unit/test_fl_speed.py``). A batch whose every example was unreadable
(``EMPTY_BATCH``) is no step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import speechbrain as sb
import torch
from speechbrain.dataio.dataloader import LoopedLoader

from speechbrain_fl.data.audio_check import EMPTY_BATCH

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
    call: no checkpointer (a :class:`~speechbrain_fl.fl.clientapp.train.ClientTask` has none), no ``torch.compile``/JIT,
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


def is_speechbrains_method(brain: sb.Brain, name: str) -> bool:
    """Whether ``brain.<name>`` is ``sb.Brain``'s method (class attribute, not in ``__dict__``)."""
    return getattr(type(brain), name) is getattr(sb.Brain, name) and name not in brain.__dict__


def lean_fit(brain: sb.Brain, train_loader: Any, epochs: int) -> None:
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
    """
    brain.init_optimizers()  # on_fit_start with no compile, wrapping or checkpointer
    for epoch in range(1, epochs + 1):
        brain.on_stage_start(sb.Stage.TRAIN, epoch)
        if not _in_train_mode(brain.modules):
            brain.modules.train()
        _zero_grad(brain, set_to_none=False)
        brain.nonfinite_count = 0
        sampler = brain.train_sampler
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in train_loader:
            if brain._optimizer_step_limit_exceeded:
                break
            if batch is EMPTY_BATCH:  # every example unreadable: nothing to train on
                continue
            brain.step += 1
            loss = brain.fit_batch(batch)
            brain.avg_train_loss = brain.update_average(loss, brain.avg_train_loss)
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


def _local_fit(task: Any, train_loader: Any, epochs: int) -> None:
    """One round's local training of ``task`` (a ClientTask): :func:`lean_fit` where it applies
    (a DataLoader or LoopedLoader, which ``Brain.fit`` would use as is), else ``brain.fit``
    with a ``fit_batch`` that skips an ``EMPTY_BATCH`` for this call only."""
    brain = task.brain
    if (
        task.lean_fit
        and isinstance(train_loader, torch.utils.data.DataLoader | LoopedLoader)
        and lean_fit_applies(brain)
    ):
        lean_fit(brain, train_loader, epochs)
        return
    fit_batch = brain.fit_batch

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

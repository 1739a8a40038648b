"""A client's training step in fp32: SpeechBrain 1.1's ``Brain.fit_batch`` and
``Brain.optimizers_step`` without the work their disabled settings make no-ops.

Why hand-written: SpeechBrain has no per-step switch for these. ``Brain.fit_batch`` enters
``no_sync`` (a generator context manager) and the ``training_ctx`` (a ``nullcontext`` in fp32),
divides the loss by ``grad_accumulation_factor`` and passes it through the ``GradScaler``'s
``scale``; ``optimizers_step`` calls the scaler's ``unscale_``, ``step`` and ``update`` and
``clip_grad_norm_`` whatever the settings; the loss's finiteness is checked twice a step
(``check_loss_isfinite``, then ``update_average``). In an fp32 client round on a small model
(``benchmarks/fl_overhead.py``: ~0.1 ms of work a step) these are a large share of the step.

When it applies (:func:`lean_fit_batch_applies`): the Brain keeps SpeechBrain's ``fit_batch``
and ``optimizers_step`` (the class attributes are ``sb.Brain``'s, nothing in the instance
``__dict__``), trains in fp32 (``precision == "fp32"``, the scaler disabled, ``training_ctx``
SpeechBrain's ``TorchAutocast`` with autocast off), ``grad_accumulation_factor == 1``, no DDP
(no ``distributed_launch``, no module of ``brain.modules`` with ``require_backward_grad_sync``,
what ``Brain.no_sync`` looks for), on a SpeechBrain release in :data:`FIT_BATCH_RELEASES`
(whose ``core.py`` this was read from). Otherwise the Brain's own ``fit_batch`` runs.

What is identical (``tests/unit/test_fl_client_lean_step.py``: parameters bit for bit against
``brain.fit`` over several rounds, SGD and Adam, a Brain overriding ``compute_objectives``):
per step, with ``should_step = True`` (``step % 1 == 0``): ``on_fit_batch_start(batch, True)``,
``compute_forward(batch, TRAIN)``, ``compute_objectives(outputs, batch, TRAIN)``, the loss
check (``check_loss_isfinite``: a Brain's own is called every step; SpeechBrain's is called
when the loss is not finite, which is when it does anything: ``nonfinite_count`` and
``nonfinite_patience`` as SpeechBrain's), ``backward()`` of the loss (SpeechBrain's
``scaler.scale(loss / 1)`` is the loss: the disabled scaler returns its input, and x / 1 == x
with gradient g / 1 == g in IEEE arithmetic), then the optimiser step: the optimisers
``freeze_optimizers`` leaves (called when a Brain overrides it; SpeechBrain's returns its
input), ``clip_grad_norm_(param_groups[0]["params"], max_grad_norm)`` unless
``max_grad_norm == inf`` (a norm and a multiplication by ``min(1, inf / (||g|| + 1e-6)) = 1``),
``check_gradients()`` when ``skip_nonfinite_grads``, ``opt.step()`` (what the disabled scaler's
``step`` calls; without torch's profiler scope around it where no profiler runs and no step
hook is registered: :func:`_optimizer_step`), ``zero_grad(set_to_none=True)`` (the same,
:func:`_zero_grad_to_none`), ``optimizer_step += 1``, then
``on_fit_batch_end(batch, outputs, loss, True)``. The step returns ``loss.detach().cpu()`` as
SpeechBrain's does, and the loss as a Python float (``loss.item()``, read once: it decides the
check and :func:`speechbrain_fl.fl.local_fit.lean_fit`'s running average, SpeechBrain's
``update_average`` arithmetic on ``float(loss)``).

One difference, for a non-finite gradient under ``max_grad_norm == inf``: SpeechBrain's
``clip_grad_norm_`` multiplies every gradient by ``inf / inf = nan``, this leaves the finite
ones as they are (as :func:`speechbrain_fl.fl.client_optimizer._unclipped_optimizers_step`);
the update is non-finite either way and the server drops a non-finite reply.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import speechbrain as sb
import torch
import torch.optim.optimizer as _optim
from speechbrain.utils.autocast import TorchAutocast

__all__ = [
    "FIT_BATCH_RELEASES",
    "is_speechbrains_method",
    "lean_fit_batch",
    "lean_fit_batch_applies",
]

#: SpeechBrain releases whose ``Brain.fit_batch`` and ``optimizers_step`` :func:`lean_fit_batch`
#: reproduces (read from speechbrain/core.py of 1.1.x); another release keeps its own.
FIT_BATCH_RELEASES = ("1.1.",)


def is_speechbrains_method(brain: sb.Brain, name: str) -> bool:
    """Whether ``brain.<name>`` is ``sb.Brain``'s method (class attribute, not in ``__dict__``)."""
    return getattr(type(brain), name) is getattr(sb.Brain, name) and name not in brain.__dict__


def lean_fit_batch_applies(brain: sb.Brain) -> bool:
    """Whether :func:`lean_fit_batch` makes ``brain.fit_batch``'s calls (module docstring).

    Example
    -------
    >>> from speechbrain_fl.fl.toy import toy_client, toy_settings
    >>> from flwr.app import Context, RecordDict
    >>> ctx = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    >>> brain = toy_client(ctx, toy_settings()).brain
    >>> lean_fit_batch_applies(brain)
    True
    >>> brain.grad_accumulation_factor = 2
    >>> lean_fit_batch_applies(brain)
    False
    """
    ctx = getattr(brain, "training_ctx", None)
    scaler = getattr(brain, "scaler", None)
    return (
        sb.__version__.startswith(FIT_BATCH_RELEASES)
        and is_speechbrains_method(brain, "fit_batch")
        and is_speechbrains_method(brain, "optimizers_step")
        and getattr(brain, "precision", None) == "fp32"
        and scaler is not None
        and not scaler.is_enabled()
        and type(ctx) is TorchAutocast
        and isinstance(ctx.context, nullcontext)
        and getattr(brain, "grad_accumulation_factor", None) == 1
        and not getattr(brain, "distributed_launch", False)
        and not any(hasattr(m, "require_backward_grad_sync") for m in brain.modules.values())
    )


def _optimizers_step(brain: sb.Brain, own_freeze: bool) -> None:
    """SpeechBrain 1.1's ``Brain.optimizers_step`` with the scaler disabled (module docstring)."""
    if brain.optimizers_dict is not None:
        optimizers = brain.optimizers_dict
        if own_freeze:
            optimizers = brain.freeze_optimizers(optimizers)
    elif brain.opt_class is not None:
        optimizers = {"optimizer": brain.optimizer}
    else:
        return
    if brain.max_grad_norm != math.inf:
        for opt in optimizers.values():
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], brain.max_grad_norm)
    if brain.skip_nonfinite_grads:
        brain.check_gradients()
    for opt in optimizers.values():
        _optimizer_step(opt)
    for opt in optimizers.values():
        _zero_grad_to_none(opt)
    brain.optimizer_step += 1


def _profiled_step_code() -> Any:
    """The code object of torch's ``Optimizer.profile_hook_step`` wrapper (what every
    ``torch.optim`` optimiser class's ``step`` is wrapped in at its first construction)."""
    return torch.optim.Optimizer.profile_hook_step(lambda self: None).__code__


_STEP_WRAPPER = _profiled_step_code()


def _unobserved(opt: torch.optim.Optimizer) -> bool:
    """No profiler running and no optimiser step hook, global or on ``opt``."""
    return (
        not torch.autograd._profiler_enabled()
        and not _optim._global_optimizer_pre_hooks
        and not _optim._global_optimizer_post_hooks
        and getattr(opt, "_optimizer_step_pre_hooks", None) == {}
        and getattr(opt, "_optimizer_step_post_hooks", None) == {}
    )


def _optimizer_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``, calling the optimiser's own ``step`` inside torch's profiling wrapper
    directly where the wrapper would only add its ``record_function`` scope.

    torch 2.x wraps an optimiser class's ``step`` (``Optimizer.profile_hook_step``) in a
    ``record_function("Optimizer.step#<class>.step")`` scope around the global and per-optimiser
    pre-hooks, the step, ``_optimizer_step_code()`` (a no-op the profiler hooks into) and the
    post-hooks. With no profiler running and no hook registered, that is the step and the no-op:
    the same calls here, without the scope (~5-10 us a step). Any other ``step`` (not that
    wrapper, one set on the instance, such as an LR scheduler's counting wrapper or a compiled
    step, or an observed one) is called as ``opt.step()``.
    """
    step = type(opt).step
    inner = getattr(step, "__wrapped__", None)
    if (
        inner is not None
        and getattr(step, "__code__", None) is _STEP_WRAPPER
        and "step" not in opt.__dict__  # e.g. an LR scheduler's wrapper, a compiled step
        and _unobserved(opt)
    ):
        inner(opt)
        opt._optimizer_step_code()
        return
    opt.step()


def _zero_grad_to_none(opt: torch.optim.Optimizer) -> None:
    """``opt.zero_grad(set_to_none=True)``: torch's ``Optimizer.zero_grad`` sets every
    parameter's ``grad`` that is not ``None`` to ``None`` inside a ``record_function`` scope;
    the same assignments here without the scope where no profiler runs (an optimiser with its
    own ``zero_grad``, on its class or instance, gets its call)."""
    if (
        type(opt).zero_grad is not torch.optim.Optimizer.zero_grad
        or "zero_grad" in opt.__dict__
        or torch.autograd._profiler_enabled()
    ):
        opt.zero_grad(set_to_none=True)
        return
    if not hasattr(opt, "_zero_grad_profile_name"):
        opt._patch_step_function()  # what torch's zero_grad does first
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


def lean_fit_batch(brain: sb.Brain, batch: Any) -> tuple[torch.Tensor, float]:
    """One training step of ``brain`` on ``batch``: ``brain.fit_batch(batch)``'s calls in fp32.

    For a Brain where :func:`lean_fit_batch_applies` (see the module docstring for the calls
    and why the update is bit-identical).

    Arguments
    ---------
    brain : speechbrain.Brain
        The client's Brain.
    batch : Any
        One batch of its training loader.

    Returns
    -------
    loss : torch.Tensor
        ``loss.detach().cpu()``, what ``Brain.fit_batch`` returns.
    value : float
        ``loss.item()``.
    """
    brain.on_fit_batch_start(batch, True)
    outputs = brain.compute_forward(batch, sb.Stage.TRAIN)
    loss = brain.compute_objectives(outputs, batch, sb.Stage.TRAIN)
    value = loss.item()
    if not is_speechbrains_method(brain, "check_loss_isfinite") or not math.isfinite(value):
        brain.check_loss_isfinite(loss)
    loss.backward()
    _optimizers_step(brain, not is_speechbrains_method(brain, "freeze_optimizers"))
    brain.on_fit_batch_end(batch, outputs, loss, True)
    return loss.detach().cpu(), value

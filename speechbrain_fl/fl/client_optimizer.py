"""The client Brain's optimiser across rounds: built once and reset, stepped without a no-op clip.

Used by :func:`speechbrain_fl.fl.client.train_round` around each round's local training.

- The optimiser is made once per Brain and *reset* before every round instead of rebuilt:
  its per-parameter state (momenta, Adam moments, step counts) is cleared and its param
  groups' hyperparameters are put back to the values it was built with, so round r+1 starts
  from the same optimiser as a freshly built one and no local state crosses rounds
  (``tests/unit/test_fl_speed.py``). Only a Brain that keeps SpeechBrain's own
  ``init_optimizers`` (one optimiser over ``brain.modules.parameters()``) is treated so; a
  Brain that overrides it (e.g. a learning rate that follows the federated round) gets its
  own ``init_optimizers`` every round, as before. The hyperparameters are restored without
  deep copies of immutable values (:func:`_restore_groups`).
- No per-step work a setting switches off: with ``max_grad_norm: inf`` (SpeechBrain's per-step
  gradient clipping off) ``Brain.optimizers_step`` runs without its ``clip_grad_norm_``, which
  SpeechBrain 1.1 calls every step whatever the bound (a norm over every gradient, then a
  multiplication by 1.0): :func:`_unclipped_optimizers_step`, the same steps otherwise.

Tested in ``tests/unit/test_fl_client_rounds.py``, ``test_fl_speed.py`` and
``test_fl_client_step.py``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

import speechbrain as sb
import torch


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

"""The client Brain's optimiser across rounds: built once, reset before every round.

Used by :func:`speechbrain_fl.fl.clientapp.train.train_round` around each round's local training.

The optimiser is made once per Brain and *reset* before every round instead of rebuilt:
its per-parameter state (momenta, Adam moments, step counts) is cleared and its param
groups' hyperparameters are put back to the values it was built with, so round r+1 starts
from the same optimiser as a freshly built one and no local state crosses rounds
(``tests/unit/test_fl_speed.py``). Only a Brain that keeps SpeechBrain's own
``init_optimizers`` (one optimiser over ``brain.modules.parameters()``) is treated so; a
Brain that overrides it (e.g. a learning rate that follows the federated round) gets its
own ``init_optimizers`` every round, as before. The hyperparameters are restored without
deep copies of immutable values (:func:`_restore_groups`).

Tested in ``tests/unit/test_fl_client_rounds.py`` and ``test_fl_speed.py``.
"""

from __future__ import annotations

import contextlib
import copy
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
    listed them, e.g. a :class:`speechbrain_fl.fl.params.ParameterIndex`). Another ``init_optimizers`` runs as is.
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

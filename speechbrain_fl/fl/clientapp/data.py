"""A client's training data per round: the DataLoader made once, a fresh batch order every round.

Used by :func:`speechbrain_fl.fl.clientapp.train.train_round`; the task is a
:class:`~speechbrain_fl.fl.clientapp.train.ClientTask` (typed ``Any`` here: :mod:`speechbrain_fl.fl.clientapp.train` imports this
module, so importing ``ClientTask`` back would make an import loop).

- The training DataLoader is made once per ClientTask (``brain.make_dataloader``, exactly what
  ``Brain.fit`` would make each round) and passed to ``brain.fit``. Its order is fresh every
  round and client: SpeechBrain's shuffling sampler (``seed + epoch``) gets a seed mixed from
  its own, the round seed and the partition id (:func:`_round_sampler_seed`), then is set per
  epoch (``set_epoch``); other samplers draw from the torch RNG, which each round reseeds.
- Collation: a loader whose ``collate_fn`` is SpeechBrain's ``PaddedBatch`` itself gets
  :func:`speechbrain_fl.fl.clientapp.collation.stacked_padded_batch`: the same ``PaddedBatch``, built attribute by
  attribute where every value is an equal-shape tensor (one ``torch.stack`` per key), with
  ``pad_right_stacked`` padding otherwise (the same batches, tested field by field;
  ``ClientTask.fast_collate=False`` keeps the collate function as given). The toy dataset
  serves a batch with torch's ``__getitems__`` as a :class:`speechbrain_fl.fl.clientapp.collation.TensorRows` list, so
  the per-value check is decided once, by the dataset.
- Unreadable audio: the collate function is wrapped in
  :class:`~speechbrain_fl.data.audio_check.SkippingCollate`, so an example whose file fails to
  decode is dropped (and counted for the reply), not the client's round.

Tested in ``tests/unit/test_fl_client_data.py`` and ``test_fl_client_batch_order.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import speechbrain as sb
import torch
from speechbrain.dataio.batch import PaddedBatch
from speechbrain.dataio.dataset import DynamicItemDataset

from speechbrain_fl.data.audio_check import SkippingCollate
from speechbrain_fl.fl.clientapp.collation import TensorRows
from speechbrain_fl.fl.clientapp.collation import stacked_padded_batch as _stacked_padded_batch


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

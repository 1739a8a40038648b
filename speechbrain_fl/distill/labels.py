"""Which D_aux records the student may read the label of: a stratified subset, the rest hidden.

A public D_aux is often mostly unlabelled: a few clips carry labels, the rest only the
teacher's outputs. :func:`hide_labels` keeps ``count`` labels, stratified by class (largest
remainder of ``count * n_c / n``, at least one per class present while ``count`` allows),
drawn from ``seed``, and sets every other label to :data:`IGNORE_LABEL`, which the KD loss's
CE term skips (``kd_loss``). The KL term uses every record.

Example
-------
>>> import torch
>>> labels = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 2])
>>> kept = hide_labels(labels, count=4, seed=0)
>>> int((kept != IGNORE_LABEL).sum()), sorted(set(kept[kept != IGNORE_LABEL].tolist()))
(4, [0, 1, 2])
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["IGNORE_LABEL", "hide_labels"]

#: ``torch.nn.functional.cross_entropy``'s default ``ignore_index``.
IGNORE_LABEL = -100


def hide_labels(labels: torch.Tensor, *, count: int | None, seed: int) -> torch.Tensor:
    """A copy of ``labels`` with all but ``count`` of them set to :data:`IGNORE_LABEL`.

    Arguments
    ---------
    labels : (N,) long tensor
        Class indices.
    count : int or None
        Labels to keep (``None`` or ``>= N``: all).
    seed : int
        Seed of the draw (same labels, count and seed: same subset).
    """
    labels = labels.clone()
    n = labels.numel()
    if count is None or count >= n:
        return labels
    if count < 0:
        raise ValueError(f"count must be >= 0 or None, got {count}")
    rng = np.random.default_rng([int(seed), 7301])
    values = labels.numpy()
    classes = np.unique(values)
    sizes = np.array([(values == c).sum() for c in classes])
    raw = count * sizes / n
    quota = np.floor(raw).astype(int)
    for i in np.argsort(raw - quota)[::-1][: count - quota.sum()]:
        quota[i] += 1
    for i in np.argsort(sizes):  # at least one label per class while count allows
        if quota[i] == 0 and count >= len(classes):
            quota[int(np.argmax(quota))] -= 1
            quota[i] = 1
    keep = np.zeros(n, dtype=bool)
    for c, k in zip(classes, quota, strict=True):
        members = np.flatnonzero(values == c)
        keep[rng.choice(members, size=min(k, members.size), replace=False)] = True
    labels[torch.from_numpy(~keep)] = IGNORE_LABEL
    return labels

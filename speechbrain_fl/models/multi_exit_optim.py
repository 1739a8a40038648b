"""Optimisation of a multi-exit model: the lr schedule, the parameter groups, balanced sampling.

- :func:`lr_factor`: linear warmup then cosine decay to a floor, over federated rounds (a
  client's lr in round t) or over optimiser steps (the centralized scenario, one ``fit``);
- :class:`WarmupCosine`: that schedule as the object the hparams file builds
  (``lr_annealing``);
- :func:`build_optimizer`: the hparams file's optimiser class (``opt_class``, AdamW) with the
  backbone and the exit heads in separate groups (``backbone_lr_multiplier``), at a given
  schedule factor;
- :func:`balanced_sampler`: a class-balanced sampler for a training manifest
  (``balanced_sampling``; e.g. ``_unknown_`` is about 60% of real Speech Commands v0.01).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import collections
import csv
import math

import torch

__all__ = ["WarmupCosine", "balanced_sampler", "build_optimizer", "lr_factor"]


def lr_factor(step, total, *, warmup_fraction=0.0, min_ratio=0.0):
    """Share of the peak lr at ``step`` (1-based) of ``total``: warmup, then cosine to a floor.

    With W = round(warmup_fraction * total) warmup steps and floor m = ``min_ratio``::

        f(s) = s / W                                              for s <= W
        f(s) = m + (1 - m) * (1 + cos(pi * (s - W - 1) / (T - W))) / 2    otherwise

    so the first step after warmup runs at the peak and the last one just above the floor.
    ``step`` is the federated round (the client's lr is constant within a round) or the
    optimiser step of the centralized run.

    Example
    -------
    >>> [round(lr_factor(s, 10, warmup_fraction=0.2, min_ratio=0.1), 3) for s in (1, 2, 3, 10)]
    [0.5, 1.0, 1.0, 0.134]
    >>> lr_factor(1, 1)
    1.0
    """
    total = max(1, int(total))
    step = min(max(1, int(step)), total)
    warmup = int(round(float(warmup_fraction) * total))
    if warmup and step <= warmup:
        return step / warmup
    span = max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * (step - warmup - 1) / span))
    return float(min_ratio) + (1.0 - float(min_ratio)) * cosine


class WarmupCosine:
    """The lr schedule of the hparams file (``lr_annealing``): :func:`lr_factor` as an object.

    ``schedule(step, total)`` is ``lr_factor(step, total, warmup_fraction=...,
    min_ratio=...)``: the share of the peak lr at round (or optimiser step) ``step`` of
    ``total``.

    Example
    -------
    >>> schedule = WarmupCosine(warmup_fraction=0.2, min_ratio=0.1)
    >>> schedule(1, 10), round(schedule(10, 10), 3)
    (0.5, 0.134)
    """

    def __init__(self, *, warmup_fraction=0.0, min_ratio=1.0):
        self.warmup_fraction = warmup_fraction
        self.min_ratio = min_ratio

    def __call__(self, step, total):
        """The factor at ``step`` of ``total`` (see :func:`lr_factor`)."""
        return lr_factor(
            step, total, warmup_fraction=self.warmup_fraction, min_ratio=self.min_ratio
        )


def build_optimizer(model, *, opt_class, lr, backbone_lr_multiplier=1.0, factor=1.0):
    """``opt_class`` over the trainable tensors, the heads and the backbone in their own groups.

    ``opt_class`` is the hparams file's optimiser (``!name:torch.optim.AdamW`` with its
    ``weight_decay`` bound), called as ``opt_class(groups, lr=lr * factor)``. The groups' lrs
    are the peak ones times ``factor``: heads ``lr * factor``, backbone
    ``lr * backbone_lr_multiplier * factor``; each group keeps its peak in ``initial_lr`` for a
    per-step scheduler.
    """
    lr = float(lr)
    multiplier = float(backbone_lr_multiplier)
    groups = model.param_groups(lr * factor, lr * multiplier * factor)
    for group in groups:
        group["initial_lr"] = group["lr"] / factor if factor else group["lr"]
    return opt_class(groups, lr=lr * factor)


def balanced_sampler(manifest, *, label_key="label", num_samples=None):
    """A :class:`torch.utils.data.WeightedRandomSampler` drawing every class equally often.

    Weight of a clip of class c: 1 / n_c (n_c clips of class c in ``manifest``), so each class
    is drawn with probability 1 / C per draw; ``num_samples`` defaults to the manifest's size
    (one epoch = as many draws as clips, with replacement). Its draws come from torch's global
    generator, which the engine reseeds for every client and round.

    Example
    -------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.csv")
    >>> _ = open(path, "w").write("ID,label\\na,x\\nb,x\\nc,x\\nd,y\\n")
    >>> sampler = balanced_sampler(path)
    >>> [round(w, 3) for w in sampler.weights.tolist()]
    [0.333, 0.333, 0.333, 1.0]
    """
    with open(manifest, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise ValueError(f"balanced_sampling: {manifest} has no clips")
    if label_key not in rows[0]:
        raise ValueError(
            f"balanced_sampling: {manifest} has no {label_key!r} column (a classification "
            "task's manifest is needed; ASR has no classes)"
        )
    counts = collections.Counter(row[label_key] for row in rows)
    weights = torch.tensor([1.0 / counts[row[label_key]] for row in rows], dtype=torch.double)
    return torch.utils.data.WeightedRandomSampler(
        weights, num_samples=int(num_samples or len(rows)), replacement=True
    )

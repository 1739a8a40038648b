"""Layer-wise partial aggregation (:mod:`speechbrain_fl.fl.aggregate.layerwise`) under SecAgg+: masked sums and weights.

The layer-wise rule averages each tensor p over the clients that trained it,

    delta^p = sum_{i in S_p} a_i delta_i^p / sum_{i in S_p} a_i,

with a_i = n_i L_i (``depth_aware``), n_i (``samples``) or 1 (``uniform``). Under secure
aggregation the server may learn neither a_i nor S_i (which tensors client i trained), so each
client sends one vector of fixed length, masked as a whole: for every global tensor p its
weighted update a_i' delta_i^p (zeros when it did not train p), then for every p one weight
entry a_i' c (0 when it did not train p), where a_i' = a_i / A in (0, 1] is the client's weight
scaled by the server's bound A on it and c the encoding's box (:func:`layerwise_vector`). The
unmasked sum gives sum_i a_i' delta_i^p and sum_i a_i' [p in S_i] per tensor, and their
quotient is the rule's delta^p (:func:`layerwise_average`): the scale A cancels. A tensor no
survivor trained has a zero weight sum, encoded exactly (0 maps to the integer T/2 with no
rounding), and keeps its global value.

The bound A (:func:`weight_scale`): the largest partition size the server knows (simulation) or
``max_num_examples`` (deployment), times the deepest exit for ``depth_aware``. A client whose
weight exceeds it fails its round (its update is not summed).

What is lost with the server blind: the check that a partial reply declares an exit and carries
only tensors at or below it. The box cuts each coordinate of a_i' delta_i^p to [-c, c].
Layer-wise rules are not sensitivity-bounded, so these runs are non-private (docs in
:mod:`speechbrain_fl.fl.aggregate.layerwise`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from speechbrain_fl.fl.aggregate.layerwise import client_weight
from speechbrain_fl.fl.aggregate.update import ClientUpdate

__all__ = ["layerwise_average", "layerwise_vector", "weight_scale"]


def weight_scale(strategy: Any, weighting: str) -> float:
    """A, the server's bound on a client's weight a_i for ``weighting``.

    Example
    -------
    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(max_num_examples=None)
    >>> s = SimpleNamespace(config=cfg, partition_sizes=[10, 40], depth_names={3: {}, 6: {}})
    >>> weight_scale(s, "uniform"), weight_scale(s, "samples"), weight_scale(s, "depth_aware")
    (1.0, 40.0, 240.0)
    """
    if weighting == "uniform":
        return 1.0
    sizes = strategy.partition_sizes
    largest = max(sizes) if sizes else strategy.config.max_num_examples
    if largest is None:
        raise ValueError(
            f"layer-wise secure aggregation with weighting {weighting} needs a bound on a "
            "client's num-examples: the partition sizes (simulation) or max_num_examples"
        )
    if weighting == "samples":
        return float(largest)
    if not strategy.depth_names:
        raise ValueError(
            "layer-wise secure aggregation with weighting depth_aware needs the model's exits "
            "(the ServerTask's depth_names)"
        )
    return float(largest) * float(max(strategy.depth_names))


def layerwise_vector(
    delta: Mapping[str, torch.Tensor],
    *,
    shapes: Mapping[str, tuple[int, ...]],
    metrics: Mapping[str, Any],
    weighting: str,
    scale: float,
    box: float,
) -> list[np.ndarray]:
    """One client's vector: a' delta^p (or zeros) for every tensor, then a' c (or 0) for each.

    ``shapes`` lists the global tensors in the order the server reads them back.

    Example
    -------
    >>> out = layerwise_vector({"a": torch.ones(2)}, shapes={"a": (2,), "b": (1,)},
    ...     metrics={"num-examples": 5}, weighting="samples", scale=10.0, box=2.0)
    >>> [x.tolist() for x in out]
    [[0.5, 0.5], [0.0], [1.0], [0.0]]
    """
    unknown = sorted(set(delta) - set(shapes))
    if unknown:
        raise KeyError(f"the update names tensors {unknown[:5]} not in the global model")
    weight = client_weight(ClientUpdate(0, {}, dict(metrics)), weighting) / float(scale)
    if not 0.0 < weight <= 1.0:
        raise ValueError(
            f"client weight {weight * scale:g} ({weighting}) is outside (0, {scale:g}], the "
            "server's bound: its update cannot be encoded"
        )
    values = [
        delta[n].detach().to(torch.float64).numpy() * weight
        if n in delta
        else np.zeros(shape, dtype=np.float64)
        for n, shape in shapes.items()
    ]
    weights = [np.array([weight * box if n in delta else 0.0]) for n in shapes]
    return values + weights


def layerwise_average(
    mean: Sequence[np.ndarray], *, names: Sequence[str], survivors: int, box: float
) -> dict[str, torch.Tensor]:
    """The rule's delta^p from SecAgg+'s mean over ``survivors`` clients of their vectors.

    Example
    -------
    >>> mean = [np.array([0.25, 0.25]), np.array([0.0]), np.array([0.5]), np.array([0.0])]
    >>> {k: v.tolist() for k, v in layerwise_average(mean, names=["a", "b"], survivors=2,
    ...     box=2.0).items()}
    {'a': [1.0, 1.0]}
    """
    count = len(names)
    if len(mean) != 2 * count:
        raise ValueError(f"expected {2 * count} arrays (sums and weights), got {len(mean)}")
    out = {}
    for i, name in enumerate(names):
        total_weight = survivors * float(np.asarray(mean[count + i]).reshape(-1)[0]) / box
        if total_weight > 1e-9:  # untrained tensors sum to an exact zero (module docstring)
            values = survivors * np.asarray(mean[i], dtype=np.float64) / total_weight
            out[name] = torch.from_numpy(values)
    return out

"""Pluggable aggregation rules for client updates.

An aggregation rule maps the validated (and, under DP, re-clipped) client updates of a round to
one aggregate update ``{parameter name: tensor}``. The DP wrapper in
:mod:`speechbrain_fl.fl.serverapp.strategy` calls the rule *after* server-side re-clipping and *before*
adding noise, so it composes with any rule whose per-client L2 contribution is at most
``||delta_i|| / n`` (n the expected cohort size): that is the sensitivity C/n the Gaussian noise
N(0, (sigma C / n)^2) is calibrated to (docs/design.md contract 4). A rule declares this with the
attribute ``dp_sensitivity_bounded = True``; the strategy refuses a DP run with a rule that does
not. Rules may leave a parameter out of the aggregate (partial aggregation, e.g. SUPERB's
per-parameter averaging over the clients that trained it); that parameter is then not updated.

- :func:`uniform_mean`: sum_i delta_i / n. With n = qK the expected cohort size this is the
  DP-FedAvg estimator (McMahan et al., 2018, Alg. 1, "fixed denominator"): dividing by the
  realised count instead would make the sensitivity depend on the (private) cohort size.
- :func:`weighted_mean`: sum_i w_i delta_i / sum_i w_i with w_i = ``num-examples`` (FedAvg,
  McMahan et al., 2017). Not sensitivity-bounded; for non-private runs only.
- the layer-wise rules of :mod:`speechbrain_fl.fl.aggregate.layerwise` (``layerwise``, ``layerwise_<weighting>``,
  ``fedavg_full``), imported here one way (:mod:`speechbrain_fl.fl.aggregate.layerwise` imports only :mod:`speechbrain_fl.fl.aggregate.update`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from speechbrain_fl.fl.aggregate.layerwise import RULES as LAYERWISE_RULES
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.privacy.clipping.packing import packed_buffer

__all__ = ["AggregationRule", "get_rule", "register_rule", "uniform_mean", "weighted_mean"]


AggregationRule = Callable[..., dict[str, torch.Tensor]]


#: Dtypes accumulated through NumPy (:func:`_add_weighted`); others (bfloat16) through torch.
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def _numpy_path(tensor: torch.Tensor, weight: float) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in _NUMPY_DTYPES and type(weight) is float


def _add_weighted(
    total: torch.Tensor, tensor: torch.Tensor, weight: float, scratch: torch.Tensor
) -> None:
    """``total += tensor.to(float64) * weight`` in place, the same two roundings (the product
    in float64, then the sum), ``scratch`` a float64 buffer of ``tensor``'s shape.

    On CPU, NumPy's ``multiply(..., dtype=float64)`` casts (exactly) and multiplies in one
    pass, where torch's ``copy_`` then ``mul_`` make two: one pass over the update fewer.
    """
    tensor = tensor.detach()
    if _numpy_path(tensor, weight):
        out = scratch.numpy()
        np.multiply(tensor.numpy(), weight, out=out, dtype=np.float64)
        np.add(total.numpy(), out, out=total.numpy())
    else:
        total.add_(scratch.copy_(tensor).mul_(weight))


def _weighted(tensor: torch.Tensor, weight: float) -> torch.Tensor:
    """``tensor.to(float64) * weight`` (a new tensor), in one NumPy pass on CPU."""
    tensor = tensor.detach()
    if _numpy_path(tensor, weight):
        out = torch.empty(tensor.shape, dtype=torch.float64)
        np.multiply(tensor.numpy(), weight, out=out.numpy(), dtype=np.float64)
        return out
    return tensor.to(torch.float64) * weight


#: Elements of the aggregate summed at a time by :func:`_packed_sum` (256 KiB of float64: the
#: block of the sum and its scratch stay in a core's L2 cache while every reply adds to them).
BLOCK = 32768


def _packed_sum(
    updates: Sequence[ClientUpdate], weights: Sequence[float]
) -> dict[str, torch.Tensor] | None:
    """:func:`_weighted_sum` over the replies' packed buffers, or ``None`` when a reply is not
    packed, not on the NumPy path, or its tensors' names, order or shapes differ from the
    first's.

    Block by block (:data:`BLOCK` elements) every reply adds its term to that block of the
    sum: the sum and the scratch are read and written from cache, the replies are read once
    (one pass over each whole reply instead would stream the float64 sum and scratch through
    memory once per reply). Element by element the same operations in the same order:
    ``((w_1 u_1 + w_2 u_2) + w_3 u_3) + ...``, each product rounded to float64.
    """
    spec = [(name, t.shape) for name, t in updates[0].delta.items()]
    arrays = []
    for update, weight in zip(updates, weights, strict=True):
        if [(name, t.shape) for name, t in update.delta.items()] != spec:
            return None
        buffer = packed_buffer(list(update.delta.values()))  # how replies.py decodes
        if buffer is None or not _numpy_path(buffer, weight):
            return None
        arrays.append(buffer.numpy())
    size = arrays[0].size
    total = torch.empty(size, dtype=torch.float64)
    out, scratch = total.numpy(), np.empty(min(BLOCK, size))
    for start in range(0, size, BLOCK):
        stop = min(start + BLOCK, size)
        block, term = out[start:stop], scratch[: stop - start]
        np.multiply(arrays[0][start:stop], weights[0], out=block, dtype=np.float64)
        for array, weight in zip(arrays[1:], weights[1:], strict=True):
            np.multiply(array[start:stop], weight, out=term, dtype=np.float64)
            np.add(block, term, out=block)
    result, offset = {}, 0
    for name, shape in spec:
        count = shape.numel()
        result[name] = total[offset : offset + count].view(shape)
        offset += count
    return result


def _weighted_sum(
    updates: Sequence[ClientUpdate], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """``sum_i w_i u_i`` in float64, accumulated in place into the first term (one scratch
    buffer per tensor name: the same roundings as ``total + u.to(float64) * w``, without
    three allocations per term). Replies decoded into one buffer each (the server's
    :mod:`speechbrain_fl.fl.serverapp.replies`) are summed as whole buffers (:func:`_packed_sum`); the aggregate's tensors
    are then views of one float64 buffer."""
    if updates:
        packed = _packed_sum(updates, weights)
        if packed is not None:
            return packed
    total: dict[str, torch.Tensor] = {}
    scratch: dict[str, torch.Tensor] = {}
    for update, weight in zip(updates, weights, strict=True):
        for name, tensor in update.delta.items():
            if name not in total:
                total[name] = _weighted(tensor, weight)
                continue
            if name not in scratch:
                scratch[name] = torch.empty(tensor.shape, dtype=torch.float64)
            _add_weighted(total[name], tensor, weight, scratch[name])
    return total


def uniform_mean(
    updates: Sequence[ClientUpdate], *, expected_cohort_size: float
) -> dict[str, torch.Tensor]:
    """Sum of the updates divided by the expected cohort size n (DP-FedAvg, Alg. 1).

    Arguments
    ---------
    updates : sequence of ClientUpdate
        The (re-clipped) updates of the round.
    expected_cohort_size : float
        n = qK under Poisson sampling; pass the realised count for a non-private uniform mean.

    Returns
    -------
    dict of str to torch.Tensor
        The aggregate, float64.

    Example
    -------
    >>> ups = [ClientUpdate(0, {"w": torch.ones(2)}), ClientUpdate(1, {"w": 3 * torch.ones(2)})]
    >>> uniform_mean(ups, expected_cohort_size=4.0)["w"].tolist()
    [1.0, 1.0]
    """
    if expected_cohort_size <= 0:
        raise ValueError(f"expected_cohort_size must be > 0, got {expected_cohort_size}")
    return _weighted_sum(updates, [1.0 / expected_cohort_size] * len(updates))


uniform_mean.dp_sensitivity_bounded = True  # type: ignore[attr-defined]


def weighted_mean(
    updates: Sequence[ClientUpdate], *, expected_cohort_size: float
) -> dict[str, torch.Tensor]:
    """FedAvg's mean weighted by ``num-examples`` (McMahan et al., 2017, Alg. 1).

    Arguments
    ---------
    updates : sequence of ClientUpdate
        The updates of the round.
    expected_cohort_size : float
        Unused; part of the rule signature.

    Returns
    -------
    dict of str to torch.Tensor
        The aggregate, float64.

    Example
    -------
    >>> ups = [ClientUpdate(0, {"w": torch.zeros(1)}, {"num-examples": 1}),
    ...        ClientUpdate(1, {"w": torch.ones(1)}, {"num-examples": 3})]
    >>> weighted_mean(ups, expected_cohort_size=2)["w"].item()
    0.75
    """
    del expected_cohort_size
    weights = [u.num_examples for u in updates]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"num-examples must sum to > 0, got {weights}")
    return _weighted_sum(updates, [w / total for w in weights])


weighted_mean.dp_sensitivity_bounded = False  # type: ignore[attr-defined]

_RULES: dict[str, AggregationRule] = {
    "uniform": uniform_mean,
    "weighted": weighted_mean,
    **LAYERWISE_RULES,
}


def register_rule(name: str, rule: AggregationRule) -> None:
    """Register ``rule`` under ``name`` for :func:`get_rule` (a plug-in rule).

    A rule may set ``accepts_partial = True``: its replies may then carry any non-empty subset
    of the global tensors (the ones the client trained), see :mod:`speechbrain_fl.fl.serverapp.replies`.
    """
    if name in _RULES and _RULES[name] is not rule:
        raise ValueError(f"aggregation rule {name!r} is already registered")
    _RULES[name] = rule


def get_rule(rule: str | AggregationRule) -> AggregationRule:
    """Return the rule named ``rule`` (``uniform``/``weighted``) or ``rule`` if callable."""
    if callable(rule):
        return rule
    if rule not in _RULES:
        raise ValueError(f"aggregation must be one of {sorted(_RULES)} or a callable, got {rule!r}")
    return _RULES[rule]

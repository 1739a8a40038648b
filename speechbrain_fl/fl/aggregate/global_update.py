"""theta <- theta + update: the global model's step, with the two roundings of float64 math.

The server adds the round's (noisy) aggregate to each global parameter in float64 and rounds
to the parameter's dtype (:func:`updated`); a non-finite result is refused, never applied
(:func:`all_finite`, :func:`apply_aggregate`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["all_finite", "apply_aggregate", "updated"]

#: Parameter dtypes whose update :func:`updated` makes in one NumPy pass (float16 is left to
#: torch, whose float64 -> float16 cast goes through float32).
_NUMPY_PARAMS = (torch.float32, torch.float64)


def updated(value: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``(value.to(float64) + update.to(float64)).to(value.dtype)``, the same two roundings.

    On CPU NumPy adds in float64 (``dtype=float64`` casts both inputs exactly) and rounds to
    the parameter's dtype in one pass each, without torch's two float64 temporaries.

    Example
    -------
    >>> updated(torch.ones(2), torch.full((2,), 0.5, dtype=torch.float64)).tolist()
    [1.5, 1.5]
    """
    if (
        value.device.type == "cpu"
        and update.device.type == "cpu"
        and value.dtype in _NUMPY_PARAMS
        and update.dtype in (torch.float16, torch.float32, torch.float64)
    ):
        # an overflow gives inf silently, as in torch (the caller checks finiteness); asarray:
        # the sum of two 0-d arrays is a NumPy scalar
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.asarray(
                np.add(value.detach().numpy(), update.detach().numpy(), dtype=np.float64)
            )
            if value.dtype == torch.float32:
                total = total.astype(np.float32)
        return torch.from_numpy(total)
    return (value.to(torch.float64) + update.to(torch.float64)).to(value.dtype)


def all_finite(value: torch.Tensor) -> bool:
    """``bool(torch.isfinite(value).all())``, with NumPy's check on CPU (cheaper than torch's
    on one thread).

    Example
    -------
    >>> all_finite(torch.ones(3)), all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    if value.device.type == "cpu" and value.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(value.detach().numpy()).all())
    return bool(torch.isfinite(value).all())


def apply_aggregate(
    global_params: Mapping[str, torch.Tensor], aggregate: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], str | None]:
    """theta_new = theta + aggregate per parameter; ``(new params, first non-finite name)``.

    A parameter absent from ``aggregate`` is kept. The second value is the name of the first
    parameter the step made non-finite (``None`` when all are finite); the caller refuses it.

    Example
    -------
    >>> new, bad = apply_aggregate({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float64)})
    >>> new["w"].tolist(), bad
    ([2.0, 2.0], None)
    """
    new_params = {}
    for name, value in global_params.items():
        if name in aggregate:
            value = updated(value, aggregate[name])
        if not all_finite(value):
            return new_params, name
        new_params[name] = value
    return new_params, None

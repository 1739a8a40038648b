"""A client round's update: the global tensors in, the delta and its clip statistics out.

Used by :func:`speechbrain_fl.fl.clientapp.train.train_round`, which computes
delta = local - global (:func:`_difference`), clips it with the budgets from the round's
ConfigRecord (:func:`speechbrain_fl.privacy.clip_update`) and adds :func:`_client_metrics` to the
reply's MetricRecord when clipping or when the server sends ``clip-groups`` without budgets
(FLConfig ``record_norms``: measured, nothing clipped, :data:`NORMS_ONLY_BUDGET`).

- The global tensors of a round are decoded from the message once per process and shared by
  the clients of the round that receive the same arrays (the local backend's messages share
  them; a Ray actor's unpickled messages do not, and decode as before). They are read-only
  (:func:`_global_tensors`).
- The delta is one subtraction (:func:`_difference`); the clip budgets, groups and components,
  the same JSON strings round after round, are parsed once (:func:`_parsed`).

Tested in ``tests/unit/test_fl_client_reply.py`` and ``test_fl_client_clip.py`` (the clip
against the per-tensor arithmetic it replaces).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from flwr.app import ArrayRecord

from speechbrain_fl.fl.npy_codec import decode_record

__all__ = ["NORMS_ONLY_BUDGET"]


# The last round's decoded global tensors: (names, the Arrays' bytes objects, tensors).
_DECODED: list[Any] = []


def _global_tensors(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()`` (:func:`speechbrain_fl.fl.npy_codec.decode_record`: the same tensors,
    without ``np.load``'s header parsing), decoded once per distinct payload (read-only)."""
    names = tuple(arrays.keys())
    payload = tuple(a.data for a in arrays.values())
    if (
        _DECODED
        and _DECODED[0] == names
        and all(x is y for x, y in zip(_DECODED[1], payload, strict=True))
    ):
        return _DECODED[2]
    tensors = decode_record(arrays)
    _DECODED[:] = [names, payload, tensors]  # keeps the bytes alive, so their ids stay unique
    return tensors


def _difference(param: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``param - start`` in float32 on the CPU: one new tensor (the reply's), no other copy.

    ``param.detach().cpu().to(float32) - start.to(float32)``, whose conversions return their
    input when ``param`` already is a float32 CPU tensor (the subtraction is then done
    directly; under ``torch.no_grad`` no graph is recorded either way).
    """
    if param.dtype is torch.float32 and start.dtype is torch.float32 and param.device.type == "cpu":
        return torch.sub(param, start)
    return param.detach().cpu().to(torch.float32) - start.to(torch.float32)


#: The bound used when the server asks for group norms without clipping (``clip-groups`` and
#: no ``clip-budgets``): no finite update reaches it, so nothing is clipped.
NORMS_ONLY_BUDGET = 1e300


_NORMS_ONLY_JSON = json.dumps(NORMS_ONLY_BUDGET)


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> Any:
    """``json.loads(text)``, parsed once per distinct string: the clip budgets, groups and
    components a server sends are the same string round after round (and for every client of
    a round). The result is shared: read it, never modify it (``clip_update`` and
    :func:`_client_metrics` only read)."""
    return json.loads(text)


def _client_metrics(stats: Any, groups: list[str], comps: list[str]) -> dict[str, Any]:
    """The reply's clip statistics from ``clip_update``'s ``stats``: per group and component
    (in the server's order ``groups``, ``comps``) the pre-clip norm and whether it was
    clipped, the joint norm and the clip ratio."""
    return {
        "group-norms": [float(stats.group_norms.get(g, 0.0)) for g in groups],
        "group-clipped": [float(bool(stats.clipped.get(g, False))) for g in groups],
        "component-norms": [float(stats.component_norms.get(c, 0.0)) for c in comps],
        "component-clipped": [float(bool(stats.component_clipped.get(c, False))) for c in comps],
        "joint-norm": float(stats.joint_norm),
        "clip-ratio": float(stats.clip_ratio),
    }

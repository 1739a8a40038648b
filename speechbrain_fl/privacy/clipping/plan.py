"""What a clip derives from a layout alone, computed once per :class:`Layout` object.

The order of the update's parameters, the group and component index of each, and whether every
group is one tensor depend only on the layout (or, without one, on the update's keys); a client
clips an update with the same layout every round, so :func:`_plan` caches them (weakly per
layout object, by keys otherwise).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from speechbrain_fl.privacy.layout import Layout


class _Plan:
    """What :func:`clip_update` derives from a layout alone, computed once per layout object."""

    def __init__(self, layout: Layout | None, keys: tuple[str, ...]) -> None:
        if layout is None:
            self.group_names = keys
            self.labels = ("all",) * len(keys)
            self.param_keys = keys
            self.member_index = tuple(range(len(keys)))
        else:
            self.group_names = tuple(layout.names)
            self.labels = tuple(g.component for g in layout)
            param_keys, member_index = [], []
            for gi, g in enumerate(layout):
                for p in g.parameter_names:
                    param_keys.append(p)
                    member_index.append(gi)
            self.param_keys = tuple(param_keys)
            self.member_index = tuple(member_index)
        self.key_set = frozenset(self.param_keys)
        self.one_per_group = self.member_index == tuple(range(len(self.group_names)))
        self.components = tuple(dict.fromkeys(self.labels))
        comp_pos = {c: i for i, c in enumerate(self.components)}
        self.label_index = tuple(comp_pos[c] for c in self.labels)


_PLANS: dict[int, tuple[weakref.ref, _Plan]] = {}
_KEY_PLANS: dict[tuple[str, ...], _Plan] = {}


def _plan(layout: Layout | None, update: Mapping[str, torch.Tensor]) -> _Plan:
    if layout is None:  # cached by the keys (a client's update has the same ones every round)
        keys = tuple(update)
        plan = _KEY_PLANS.get(keys)
        if plan is None:
            if len(_KEY_PLANS) >= 64:
                _KEY_PLANS.clear()
            plan = _KEY_PLANS[keys] = _Plan(None, keys)
        return plan
    key = id(layout)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is layout:
        return hit[1]
    plan = _Plan(layout, ())
    _PLANS[key] = (weakref.ref(layout, lambda _ref, key=key: _PLANS.pop(key, None)), plan)
    return plan

"""A client's validated reply, the unit every aggregation rule reads.

Its own module so that :mod:`speechbrain_fl.fl.aggregate.rules` (the registry) and the rule modules it imports
(:mod:`speechbrain_fl.fl.aggregate.layerwise`) both depend on it and not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ClientUpdate"]


@dataclass
class ClientUpdate:
    """One client's validated reply.

    Arguments
    ---------
    node_id : int
        The Flower node that sent it.
    delta : dict of str to torch.Tensor
        local - global, per trainable parameter name.
    metrics : dict of str to float
        The reply's MetricRecord (``num-examples``, ``train-loss``, ...).
    """

    node_id: int
    delta: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_examples(self) -> float:
        """Return the client's ``num-examples`` (1.0 when absent)."""
        return float(self.metrics.get("num-examples", 1.0))

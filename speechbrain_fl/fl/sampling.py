"""Poisson cohort sampling for federated rounds.

Flower's strategies sample a fixed number of nodes per round (``random.sample``). The privacy
accountant of :mod:`speechbrain_fl.privacy` assumes *Poisson* sampling: every client joins a
round independently with probability ``q``, so the cohort size is Binomial(K, q) with mean
n = qK (Abadi et al., 2016, Sec. 3.1; McMahan et al., 2018, "DP-FedAvg", Alg. 1). This module
implements that sampler with a seeded :class:`numpy.random.Generator` whose state can be
checkpointed, so that a resumed run draws exactly the cohorts an uninterrupted run would.

Decision: nodes are ordered by a stable key before the draw (the server passes their partition
ids, learned once per node with a ``query`` message; Flower's simulation draws fresh random node
ids on every run), so the cohort depends only on the partitions connected and the generator
state, and a resumed run picks the same partitions as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["PoissonSampler"]


class PoissonSampler:
    """Independent Bernoulli(q) selection of every connected node.

    Arguments
    ---------
    sampling_rate : float
        The probability ``q`` in (0, 1] that a node joins a round.
    seed : int, optional
        Seed of the generator; ``None`` seeds from the OS.

    Example
    -------
    >>> sampler = PoissonSampler(sampling_rate=0.5, seed=0)
    >>> cohort = sampler.sample(range(10))
    >>> set(cohort) <= set(range(10))
    True
    >>> sampler.expected_cohort_size(10)
    5.0
    """

    def __init__(self, sampling_rate: float, seed: int | None = None) -> None:
        if not 0.0 < float(sampling_rate) <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
        self.sampling_rate = float(sampling_rate)
        self.rng = np.random.default_rng(seed)

    def expected_cohort_size(self, population: int) -> float:
        """Return n = qK, the denominator of the DP mean (DP-FedAvg, Alg. 1)."""
        return self.sampling_rate * population

    def sample(self, node_ids: Iterable[int], *, order: dict[int, int] | None = None) -> list[int]:
        """Select each node independently with probability ``q``.

        Arguments
        ---------
        node_ids : iterable of int
            The connected nodes (the population K).
        order : dict of int to int, optional
            Stable sort key per node (e.g. its partition id); default the node id.

        Returns
        -------
        list of int
            The cohort, in key order; may be empty.
        """
        order = order or {}
        nodes = sorted((int(n) for n in node_ids), key=lambda n: (order.get(n, n), n))
        mask = self.rng.random(len(nodes)) < self.sampling_rate
        return [n for n, keep in zip(nodes, mask, strict=True) if keep]

    def state_dict(self) -> dict[str, Any]:
        """Return the generator state (a plain, picklable dict)."""
        return {"sampling_rate": self.sampling_rate, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the generator state saved by :meth:`state_dict`."""
        self.sampling_rate = float(state["sampling_rate"])
        self.rng.bit_generator.state = state["rng"]

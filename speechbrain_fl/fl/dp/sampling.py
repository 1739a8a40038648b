"""Poisson cohort sampling for federated rounds.

Flower's strategies sample a fixed number of nodes per round (``random.sample``). The privacy
accountant of :mod:`speechbrain_fl.privacy` assumes *Poisson* sampling: every client joins a
round independently with probability ``q``, so the cohort size is Binomial(K, q) with mean
n = qK (Abadi et al., 2016, Sec. 3.1; McMahan et al., 2018, "DP-FedAvg", Alg. 1). Amplification
by subsampling also assumes that nobody can predict the cohorts: a private run seeds the sampler
from the OS (128 bits of :mod:`secrets`), kept in memory only.

Decisions (ours):

- Each draw has its own generator, derived from the sampler's seed and a *draw key* (the round
  and, for a non-private run's retries, the attempt) with :class:`numpy.random.SeedSequence`.
  Nothing has to be saved to resume: a resumed non-private run (public seed) or a test with a
  fixed sampler seed draws the same cohorts as an uninterrupted run, and a resumed private run
  draws fresh OS randomness.
- Nodes are ordered by a stable key before the draw (the server passes their partition ids,
  learned once per node with a ``query`` message; Flower's simulation draws fresh random node
  ids on every run), so a cohort depends only on the partitions connected, the seed and the key.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["PoissonSampler"]


class PoissonSampler:
    """Independent Bernoulli(q) selection of every connected node.

    Arguments
    ---------
    sampling_rate : float
        The probability ``q`` in (0, 1] that a node joins a round.
    seed : int, optional
        Seed of the draws; ``None`` (default) draws one from the OS.

    Example
    -------
    >>> sampler = PoissonSampler(sampling_rate=0.5, seed=0)
    >>> cohort = sampler.sample(range(10), draw=(1, 0))
    >>> set(cohort) <= set(range(10)), cohort == sampler.sample(range(10), draw=(1, 0))
    (True, True)
    >>> sampler.expected_cohort_size(10)
    5.0
    """

    def __init__(self, sampling_rate: float, seed: int | None = None) -> None:
        if not 0.0 < float(sampling_rate) <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
        self.sampling_rate = float(sampling_rate)
        self.seeded_from_os = seed is None
        self._entropy = secrets.randbits(128) if seed is None else int(seed)
        self._draws = 0

    def expected_cohort_size(self, population: int) -> float:
        """Return n = qK, the denominator of the DP mean (DP-FedAvg, Alg. 1)."""
        return self.sampling_rate * population

    def sample(
        self,
        node_ids: Iterable[int],
        *,
        order: dict[int, int] | None = None,
        draw: Sequence[int] | None = None,
    ) -> list[int]:
        """Select each node independently with probability ``q``.

        Arguments
        ---------
        node_ids : iterable of int
            The connected nodes.
        order : dict of int to int, optional
            Stable sort key per node (e.g. its partition id); default the node id.
        draw : sequence of int, optional
            The draw key, e.g. ``(round, attempt)``; default the count of earlier unkeyed draws.

        Returns
        -------
        list of int
            The cohort, in key order; may be empty.
        """
        if draw is None:
            draw = (self._draws,)
            self._draws += 1
        key = tuple(int(k) for k in draw)
        if any(k < 0 for k in key):
            raise ValueError(f"draw key must hold integers >= 0, got {draw!r}")
        rng = np.random.default_rng(np.random.SeedSequence(self._entropy, spawn_key=key))
        order = order or {}
        nodes = sorted((int(n) for n in node_ids), key=lambda n: (order.get(n, n), n))
        mask = rng.random(len(nodes)) < self.sampling_rate
        return [n for n, keep in zip(nodes, mask, strict=True) if keep]

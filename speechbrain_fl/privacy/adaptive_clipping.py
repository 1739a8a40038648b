"""Quantile-based adaptive clipping (Andrew et al. 2021), one clip norm per budget pool.

Each sampled client reports, for every pool p of the method (one pool ``all`` for ``flat``, the
two alpha-split pools ``encoder`` and ``llm`` for ``alpha_split``), the bit

    b_p = [ ||u_p|| <= C_p ]            (u_p: the client's pre-clip update restricted to pool p)

The server sums the *centred* bits b_p - 1/2 over the replies, adds Gaussian noise and moves each
clip geometrically towards the target quantile gamma (Andrew et al. 2021, "Differentially Private
Learning with Adaptive Clipping", Algorithm 1):

    b~_p = 1/2 + sum_i (b_ip - 1/2) / n + sigma_b Z_p / n_noise,     Z_p ~ N(0, 1)
    C_p <- C_p exp(-eta_C (b~_p - gamma))

with n = qK the expected cohort (the denominator of the update's mean, contract 4) and n_noise = n
(or M of a simulated deployment, like the update's noise). With gamma = 0.5 half the clients end
up unclipped. The clip of round t is the one the round's budgets use; the update above sets the
next round's.

Sensitivity of the bits of P pools (our derivation)
--------------------------------------------------
A client contributes one centred bit per pool, the vector v = (b_1 - 1/2, ..., b_P - 1/2) with
every entry in {-1/2, +1/2}. Adding or removing one client changes the vector of sums by v, whose
L2 norm is exactly sqrt(P / 4) = sqrt(P) / 2, whatever its bits (the worst case is every case).
With N(0, sigma_b^2) on each of the P sums the count query is a Gaussian mechanism of noise
multiplier

    z_b = sigma_b / (sqrt(P) / 2) = 2 sigma_b / sqrt(P)              (:func:`count_noise_multiplier`)

(one pool, P = 1: z_b = 2 sigma_b, Andrew et al.'s factor 2). Equivalently each bit may be
scaled by 1 / sqrt(P) at sensitivity 1/2 with noise sigma_b / sqrt(P).

Theorem 1 of Andrew et al. (the pair as one Gaussian mechanism)
-------------------------------------------------------------
The update (sensitivity C, noise sigma_Delta C) and the bit sums (sensitivity sqrt(P)/2, noise
sigma_b) are released together on the same Poisson-sampled cohort. Stacking both, each scaled by
its noise std, gives one Gaussian mechanism with unit noise and squared sensitivity
sigma_Delta^-2 + z_b^-2, i.e. of noise multiplier z with z^-2 = sigma_Delta^-2 + z_b^-2. To spend
exactly the target z (the YAML ``noise_multiplier``, the one the accountant uses) the update gets

    sigma_Delta = (z^-2 - z_b^-2)^(-1/2)                             (:func:`update_noise_multiplier`)

which needs z_b > z, i.e. sigma_b > z sqrt(P) / 2; a smaller sigma_b is refused with an error.
The accountant is the run's own at z: no formula for epsilon here.

Why written here and not taken from Flower: ``flwr.supercore.differential_privacy.
compute_adaptive_noise_params`` has the one-pool formula (tests check ours equals it at P = 1),
but this package's privacy core depends on torch only (docs/design.md), Flower's functions have
no pools, and its strategies count the *clipped* bit ``norm > C`` while applying the update
rule of the *unclipped* one, compute the update's noise from the clip after the update, and
divide the count by the number of replies; the study ``benchmarks/adaptive_clip_vs_flower.py``
shows the consequence.

Randomness: the count's noise is drawn from an OS-seeded generator (a fixed ``seed`` is for
tests only and warns); its state is never saved. The clips are released values (they follow
from noisy counts) and are saved for a resume.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_COUNT_STDDEV_RATIO",
    "QuantileClipState",
    "clip_bits",
    "count_noise_multiplier",
    "default_count_stddev",
    "update_noise_multiplier",
]

logger = logging.getLogger(__name__)

#: sigma_b = n / 20 when not given (Andrew et al.'s recommendation, Flower's default).
DEFAULT_COUNT_STDDEV_RATIO = 1.0 / 20.0


def default_count_stddev(expected_cohort_size: float) -> float:
    """sigma_b = n / 20 for an expected cohort of n (Andrew et al. 2021, Section 3).

    Example
    -------
    >>> default_count_stddev(100)
    5.0
    """
    if not (math.isfinite(expected_cohort_size) and expected_cohort_size > 0):
        raise ValueError(f"expected_cohort_size must be > 0, got {expected_cohort_size!r}")
    return float(expected_cohort_size) * DEFAULT_COUNT_STDDEV_RATIO


def count_noise_multiplier(count_stddev: float, *, num_pools: int = 1) -> float:
    """z_b = 2 sigma_b / sqrt(P): the noise multiplier of the P bit sums (module docstring).

    Example
    -------
    >>> count_noise_multiplier(5.0), round(count_noise_multiplier(5.0, num_pools=2), 6)
    (10.0, 7.071068)
    """
    if not (math.isfinite(count_stddev) and count_stddev > 0):
        raise ValueError(f"clip_count_stddev must be a finite number > 0, got {count_stddev!r}")
    if isinstance(num_pools, bool) or not isinstance(num_pools, int) or num_pools < 1:
        raise ValueError(f"num_pools must be an integer >= 1, got {num_pools!r}")
    return 2.0 * float(count_stddev) / math.sqrt(num_pools)


def update_noise_multiplier(
    noise_multiplier: float, *, count_stddev: float, num_pools: int = 1
) -> float:
    """sigma_Delta = (z^-2 - z_b^-2)^(-1/2): the update's noise multiplier (Theorem 1).

    Arguments
    ---------
    noise_multiplier : float
        z > 0, the noise multiplier the pair (update, bit sums) spends together.
    count_stddev : float
        sigma_b, the std of the noise on each pool's bit sum.
    num_pools : int
        P, the pools (bits per client).

    Returns
    -------
    float
        sigma_Delta >= z.

    Example
    -------
    >>> round(update_noise_multiplier(1.0, count_stddev=5.0), 6)
    1.005038
    >>> update_noise_multiplier(1.0, count_stddev=0.4)
    Traceback (most recent call last):
    ...
    ValueError: clip_count_stddev=0.4 is too small for noise_multiplier=1.0 with 1 pool(s): the bit sums alone would need noise multiplier 2 sigma_b / sqrt(P) = 0.8 > 1.0 (Theorem 1 of Andrew et al. 2021); set clip_count_stddev > 0.5
    """
    z = float(noise_multiplier)
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"adaptive clipping needs noise_multiplier > 0, got {noise_multiplier!r}")
    z_b = count_noise_multiplier(count_stddev, num_pools=num_pools)
    if z_b <= z:
        raise ValueError(
            f"clip_count_stddev={count_stddev!r} is too small for noise_multiplier={z!r} with "
            f"{num_pools} pool(s): the bit sums alone would need noise multiplier 2 sigma_b / "
            f"sqrt(P) = {z_b:.4g} > {z!r} (Theorem 1 of Andrew et al. 2021); set "
            f"clip_count_stddev > {z * math.sqrt(num_pools) / 2:.4g}"
        )
    return (z**-2 - z_b**-2) ** -0.5


def clip_bits(
    component_norms: Mapping[str, float], pools: Mapping[str, Mapping[str, Any]]
) -> list[float]:
    """The client's bits ``[||u_p|| <= C_p]``, one per pool, in the order of ``pools``.

    ``||u_p|| = sqrt(sum_{c in pool} ||u_c||^2)`` from the pre-clip component norms (a component
    the update does not have counts 0).

    Arguments
    ---------
    component_norms : mapping of str to float
        Pre-clip L2 norm per component label (:class:`~speechbrain_fl.privacy.ClipStats`).
    pools : mapping of str to mapping
        ``{pool: {"components": [labels], "clip": C_p}}`` (what the server sends).

    Returns
    -------
    list of float
        1.0 or 0.0 per pool.

    Example
    -------
    >>> clip_bits({"encoder": 0.3, "llm": 3.0, "connector": 4.0},
    ...           {"encoder": {"components": ["encoder"], "clip": 0.5},
    ...            "llm": {"components": ["llm", "connector"], "clip": 4.0}})
    [1.0, 0.0]
    """
    bits = []
    for pool in pools.values():
        sq = math.fsum(float(component_norms.get(c, 0.0)) ** 2 for c in pool["components"])
        bits.append(1.0 if math.sqrt(sq) <= float(pool["clip"]) else 0.0)
    return bits


class QuantileClipState:
    """The clip norms of the pools, moved towards the target quantile round after round.

    Arguments
    ---------
    clips : mapping of str to float
        Initial clip norm per pool, in the pools' order (one ``all`` pool for ``flat``).
    quantile : float
        gamma in (0, 1), the target fraction of unclipped clients.
    learning_rate : float
        eta_C > 0 of the geometric update.
    count_stddev : float
        sigma_b > 0, the std of the noise on each pool's bit sum.
    seed : int, optional
        ``None`` (default) seeds from the OS; a fixed seed is for tests only (warns).

    Example
    -------
    >>> state = QuantileClipState({"all": 1.0}, quantile=0.5, learning_rate=0.2,
    ...                           count_stddev=1e-9, seed=0)
    >>> fractions = state.step({"all": 10.0}, expected_cohort_size=10)  # 10 of 10 unclipped
    >>> round(fractions["all"], 6), round(state.clips["all"], 6)  # exp(-0.2 * 0.5)
    (1.0, 0.904837)
    """

    def __init__(
        self,
        clips: Mapping[str, float],
        *,
        quantile: float,
        learning_rate: float,
        count_stddev: float,
        seed: int | None = None,
    ) -> None:
        if not clips:
            raise ValueError("adaptive clipping needs at least one pool")
        for name, value in clips.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"pool {name!r}: the clip must be finite and > 0, got {value!r}")
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1), got {quantile!r}")
        if not (math.isfinite(learning_rate) and learning_rate > 0):
            raise ValueError(f"clip_quantile_lr must be > 0, got {learning_rate!r}")
        count_noise_multiplier(count_stddev)  # checks sigma_b
        self.clips = {str(k): float(v) for k, v in clips.items()}
        self.initial = dict(self.clips)
        self.quantile = float(quantile)
        self.learning_rate = float(learning_rate)
        self.count_stddev = float(count_stddev)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        else:
            logger.warning(
                "adaptive clipping: the count noise uses the fixed seed %d; for testing only",
                seed,
            )
        self._rng = np.random.default_rng(seed)

    @property
    def pools(self) -> tuple[str, ...]:
        """The pool names, in order."""
        return tuple(self.clips)

    @property
    def total_clip(self) -> float:
        """C = sqrt(sum_p C_p^2): the joint sensitivity of a clipped update."""
        return math.sqrt(math.fsum(c * c for c in self.clips.values()))

    def fractions(self) -> dict[str, float]:
        """Each pool's share of C^2, ``C_p^2 / C^2`` (alpha of alpha-split is the encoder's)."""
        total = self.total_clip**2
        return {p: c * c / total for p, c in self.clips.items()}

    def noisy_fractions(
        self,
        bit_sums: Mapping[str, float],
        *,
        expected_cohort_size: float,
        num_counted: int | None = None,
        noise_cohort_size: float | None = None,
    ) -> dict[str, float]:
        """b~_p = 1/2 + (sum_i (b_ip - 1/2)) / n + sigma_b Z_p / n_noise (module docstring).

        Arguments
        ---------
        bit_sums : mapping of str to float
            Per pool, the sum of the counted clients' bits ``sum_i b_ip`` (uncentred).
        expected_cohort_size : float
            n = qK.
        num_counted : int, optional
            m, the clients whose bits are in the sums (centring subtracts m / 2); default
            ``n`` rounded.
        noise_cohort_size : float, optional
            M of a simulated deployment (noise sigma_b / M on the fraction); default n.
        """
        n = float(expected_cohort_size)
        if not (math.isfinite(n) and n > 0):
            raise ValueError(f"expected_cohort_size must be > 0, got {expected_cohort_size!r}")
        m = round(n) if num_counted is None else int(num_counted)
        missing = sorted(set(self.clips) - set(bit_sums))
        if missing:
            raise ValueError(f"no bit sum for pool(s) {missing}")
        scale = self.count_stddev / float(noise_cohort_size or n)
        out = {}
        for pool in self.clips:  # one normal per pool, in the pools' order
            centred = float(bit_sums[pool]) - 0.5 * m
            out[pool] = 0.5 + centred / n + scale * float(self._rng.standard_normal())
        return out

    def step(
        self,
        bit_sums: Mapping[str, float],
        *,
        expected_cohort_size: float,
        num_counted: int | None = None,
        noise_cohort_size: float | None = None,
    ) -> dict[str, float]:
        """Release the noisy fractions and apply C_p <- C_p exp(-eta_C (b~_p - gamma)).

        Returns the noisy fractions (the run's ``rounds.csv`` keeps them, not this state).
        """
        fractions = self.noisy_fractions(
            bit_sums,
            expected_cohort_size=expected_cohort_size,
            num_counted=num_counted,
            noise_cohort_size=noise_cohort_size,
        )
        for pool, b in fractions.items():
            self.clips[pool] *= math.exp(-self.learning_rate * (b - self.quantile))
        return fractions

    def state_dict(self) -> dict[str, Any]:
        """The clips and the settings (no per-round history); never the generator's state."""
        return {
            "clips": dict(self.clips),
            "initial": dict(self.initial),
            "quantile": self.quantile,
            "learning_rate": self.learning_rate,
            "count_stddev": self.count_stddev,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the clips, refusing other settings (naming the key)."""
        own = self.state_dict()
        for key in ("initial", "quantile", "learning_rate", "count_stddev"):
            if state.get(key) != own[key]:
                raise ValueError(
                    f"saved adaptive clipping state has {key}={state.get(key)!r} but this run "
                    f"uses {own[key]!r}"
                )
        if list(state["clips"]) != list(self.clips):
            raise ValueError(f"saved adaptive clipping pools {list(state['clips'])} differ "
                             f"from {list(self.clips)}")  # fmt: skip
        self.clips = {k: float(v) for k, v in state["clips"].items()}


def check_bits(bits: Any, num_pools: int) -> list[float]:
    """A reply's ``clip-bits``: a list of ``num_pools`` values each 0 or 1, else ``ValueError``.

    Example
    -------
    >>> check_bits([1.0, 0.0], 2)
    [1.0, 0.0]
    """
    if not isinstance(bits, Sequence) or isinstance(bits, str) or len(bits) != num_pools:
        raise ValueError(f"must be a list of {num_pools} bits, got {bits!r:.80}")
    out = [float(b) for b in bits]
    if any(b not in (0.0, 1.0) for b in out):
        raise ValueError(f"must hold only 0 and 1, got {bits!r:.80}")
    return out

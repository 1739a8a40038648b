"""The Gaussian mechanism on the aggregate (docs/design.md contract 4; paper Eq. 4).

The server releases ``mean_i clipped_i + N(0, (sigma * C / n)^2 I)`` with ``n`` the *expected*
cohort size under Poisson sampling (rate q), so the noise does not depend on how many clients
actually replied. A simulated deployment (``noise_cohort_size=M``, pfl-research's idea) adds the
noise of a cohort of M instead, ``N(0, (sigma * C / M)^2 I)`` on the mean of the n updates
(``sigma * C * n / M`` on their sum), whatever n.

The decisions (generators, seeding, draws) are in :class:`GaussianNoise`'s notes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .layout import Layout, check_names

__all__ = ["GaussianNoise", "noise_std", "noisy_norm_signal"]

logger = logging.getLogger(__name__)

#: The largest preparation :meth:`GaussianNoise.prepare` starts (float64 normals held through
#: the round): beyond it :meth:`GaussianNoise.add` draws them itself.
PREPARE_MAX_BYTES = 512 * 2**20

_EXECUTOR: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    """The one worker thread that prepares noise (made on first use)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise-prepare")
    return _EXECUTOR


def _check_sigma(noise_multiplier) -> float:
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)):
        raise ValueError(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def noise_std(*, noise_multiplier: float, clip: float, expected_cohort_size: float) -> float:
    """Standard deviation of the noise on the mean, ``sigma * C / n`` (paper Eq. 4).

    Example
    -------
    >>> noise_std(noise_multiplier=0.1, clip=1.0, expected_cohort_size=94)
    0.0010638297872340426
    """
    sigma = _check_sigma(noise_multiplier)
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite positive number, got {clip!r}")
    if not (math.isfinite(expected_cohort_size) and expected_cohort_size > 0):
        raise ValueError(f"expected_cohort_size must be > 0, got {expected_cohort_size!r}")
    return sigma * clip / expected_cohort_size


class GaussianNoise:
    """Adds ``N(0, (sigma C / n)^2 I)`` to an aggregate (paper Eq. 4).

    Arguments
    ---------
    noise_multiplier : float
        ``sigma`` >= 0, relative to the L2 sensitivity ``C``.
    clip : float
        The total clip ``C`` (the joint sensitivity of one client's clipped update).
    seed : int, optional
        ``None`` (default) seeds from the OS; a fixed seed is for testing only.
    noise_cohort_size : int, optional
        M of a simulated deployment: the std on the mean is ``sigma C / M`` whatever the
        cohort ``n`` given to :meth:`add`; ``None`` (default): ``sigma C / n``.

    Notes
    -----
    Decisions --------- - Noise is drawn with a dedicated generator per device (and per draw key,
    below), seeded from ``os.urandom`` by default; a fixed seed makes the noise predictable and is
    for tests only (a warning is logged). The seed lives in memory only:
    :meth:`GaussianNoise.state_dict` holds the public settings (sigma, C) and nothing from which
    past noise could be regenerated, so a saved server state cannot be used to strip the noise from
    released models; a resumed run draws from a fresh OS seed. - On CPU, for float32 and float64
    aggregates, the generator is NumPy's ``PCG64`` and the draws its ``standard_normal`` (ziggurat,
    exact unbounded tails), always in float64: ~9 ns a draw on one CPU thread here against ~14 ns
    for ``torch.randn`` in float64 (a scalar Box-Muller loop), the largest fixed cost of a private
    round of a small model (~101k draws). A float32 aggregate gets float64 noise added in float64,
    then rounded once to float32 (``torch.randn`` in float32 draws from 24-bit uniforms:
    Box-Muller's radius is then at most ~5.8, a truncated Gaussian). Other devices and dtypes
    (CUDA, bfloat16) draw with ``torch.randn`` on the tensor's device, from a ``torch.Generator``
    seeded the same way. - ``add(..., draw=k)`` derives the generator of draw ``k`` (the round)
    from the seed (SHA-256 of seed, draw and device; our choice): with a test-only fixed seed a
    resumed run then adds the same noise as an uninterrupted one, without any generator state on
    disk. - :meth:`GaussianNoise.prepare` (called by the server when it sends a round out) draws
    that round's standard normals in a worker thread while the clients train: NumPy's
    ``standard_normal`` fills without the GIL, and the noise does not depend on the replies.
    :meth:`~GaussianNoise.add` then uses them when they are exactly the draws it would make (the
    CPU NumPy path for every tensor and as many draws as the aggregate has elements:
    ``standard_normal(a + b)`` yields the draws of ``standard_normal(a)`` then
    ``standard_normal(b)``, tested) and leaves the draw's generator where its own draws would have
    left it; otherwise it draws as before, from a generator the preparation never touched. The same
    noise, bit for bit; the normals are held in memory only, never written, and not prepared beyond
    :data:`PREPARE_MAX_BYTES`. - Floating-point sampling is not hardened against the floating-point
    attacks on the Gaussian mechanism (Mironov 2012 style); like Opacus's default (non-secure) mode
    this is acceptable for research, not for adversarial deployments.

    Example
    -------
    >>> mech = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=0)
    >>> out = mech.add({"w": torch.zeros(3)}, expected_cohort_size=10)
    >>> out["w"].shape
    torch.Size([3])
    >>> GaussianNoise(noise_multiplier=1.0, clip=1.0, noise_cohort_size=1000).std(10)
    0.001
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip: float,
        seed: int | None = None,
        noise_cohort_size: int | None = None,
    ):
        self.noise_multiplier = _check_sigma(noise_multiplier)
        noise_std(noise_multiplier=self.noise_multiplier, clip=clip, expected_cohort_size=1)
        self.clip = float(clip)
        #: the clip of the run's settings (``state_dict``); :meth:`set_clip` moves :attr:`clip`
        self.base_clip = self.clip
        if noise_cohort_size is not None and (
            isinstance(noise_cohort_size, bool)
            or not isinstance(noise_cohort_size, int)
            or noise_cohort_size < 1
        ):
            raise ValueError(
                f"noise_cohort_size must be an integer >= 1, got {noise_cohort_size!r}"
            )
        self.noise_cohort_size = noise_cohort_size
        if seed is None:
            self._seed = int.from_bytes(os.urandom(8), "little") >> 1
        else:
            logger.warning(
                "GaussianNoise uses the fixed seed %d: the noise is predictable; for testing "
                "only, never for a private run",
                seed,
            )
            self._seed = int(seed)
        self._generators: dict[tuple[str, int | None], torch.Generator | np.random.Generator] = {}
        # (draw, number of normals, the generator drawing them, the future of the normals)
        self._prepared: tuple[int, int, np.random.Generator, Future] | None = None

    def _derived_seed(self, key: tuple[str, int | None]) -> int:
        """The seed of generator ``key`` = (device, draw): SHA-256 of the seed and the key."""
        label = key[0] if key[1] is None else f"{key[0]}|draw={key[1]}"
        digest = hashlib.sha256(f"{self._seed}:{label}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _keep(self, key: tuple[str, int | None], gen) -> None:
        """Store generator ``key``; a draw key is used for one release: forget older keyed ones."""
        if key[1] is not None:
            self._generators = {
                k: g for k, g in self._generators.items() if k[1] is None or k[1] == key[1]
            }
        self._generators[key] = gen

    def _generator(self, device: torch.device | str, draw: int | None):
        """The generator of ``device`` (``"numpy"``: the CPU's NumPy one) for draw ``draw``."""
        key = (str(device), None if draw is None else int(draw))
        if key not in self._generators:
            seed = self._derived_seed(key)
            if key[0] == "numpy":
                gen = np.random.Generator(np.random.PCG64(seed))
            else:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed)
            self._keep(key, gen)
        return self._generators[key]

    def prepare(self, sizes: Sequence[int], *, draw: int) -> None:
        """Start drawing the ``sum(sizes)`` standard normals of draw ``draw`` in a thread.

        For an :meth:`add` of that draw soon after (the server calls it when it sends the
        round out, with the sizes of the global tensors). A draw whose generator has been used
        already, or beyond :data:`PREPARE_MAX_BYTES`, is not prepared.

        Example
        -------
        >>> mech = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=0)
        >>> plain = mech.add({"w": torch.zeros(3)}, expected_cohort_size=10, draw=1)["w"]
        >>> mech = GaussianNoise(noise_multiplier=1.0, clip=1.0, seed=0)
        >>> mech.prepare([3], draw=1)
        >>> torch.equal(mech.add({"w": torch.zeros(3)}, expected_cohort_size=10, draw=1)["w"], plain)
        True
        """
        self._discard_prepared()
        key, total = ("numpy", int(draw)), int(sum(sizes))
        if key in self._generators or not 0 < 8 * total <= PREPARE_MAX_BYTES:
            return
        gen = np.random.Generator(np.random.PCG64(self._derived_seed(key)))
        self._prepared = (key[1], total, gen, _executor().submit(gen.standard_normal, total))

    def _discard_prepared(self) -> None:
        """Drop a preparation (after its thread is done with its generator)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared[3].exception()  # waits; an error only means it is not used

    def _take_prepared(
        self, aggregate: Mapping[str, torch.Tensor], draw: int | None
    ) -> np.ndarray | None:
        """The prepared normals if they are exactly what :meth:`add` would draw for
        ``aggregate`` (every tensor on the NumPy path, the same count, the draw's generator
        unused), with that generator stored as its own draws would have left it; else
        ``None`` (the preparation dropped)."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        prepared_draw, total, gen, future = prepared
        normals = None if future.exception() is not None else future.result()
        key = ("numpy", None if draw is None else int(draw))
        if (
            normals is None
            or key[1] != prepared_draw
            or key in self._generators
            or sum(t.numel() for t in aggregate.values()) != total
            or not all(_numpy_path(t) for t in aggregate.values())
        ):
            return None
        self._keep(key, gen)
        return normals

    def set_clip(self, clip: float) -> None:
        """Use the sensitivity ``clip`` from now on (an adaptive clip's round value C_t).

        Example
        -------
        >>> mech = GaussianNoise(noise_multiplier=2.0, clip=1.0)
        >>> mech.set_clip(0.5); mech.std(10), mech.state_dict()["clip"]
        (0.1, 1.0)
        """
        noise_std(noise_multiplier=self.noise_multiplier, clip=clip, expected_cohort_size=1)
        self.clip = float(clip)

    def std(self, expected_cohort_size: float) -> float:
        """Noise std on the mean: ``sigma C / n`` for a cohort of ``n = expected_cohort_size``,
        ``sigma C / M`` with a ``noise_cohort_size`` M (``n`` is then checked, not used)."""
        std = noise_std(
            noise_multiplier=self.noise_multiplier,
            clip=self.clip,
            expected_cohort_size=expected_cohort_size,
        )
        if self.noise_cohort_size is None:
            return std
        return noise_std(
            noise_multiplier=self.noise_multiplier,
            clip=self.clip,
            expected_cohort_size=self.noise_cohort_size,
        )

    def add(
        self,
        aggregate: Mapping[str, torch.Tensor],
        *,
        expected_cohort_size: float,
        draw: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Return new tensors ``aggregate + N(0, std^2)``; ``aggregate`` is not modified.

        Arguments
        ---------
        aggregate : mapping of str to Tensor
            The mean of the clipped updates.
        expected_cohort_size : float
            ``n = q * K`` under Poisson sampling.
        draw : int, optional
            Key of this draw (the round); default the next draw of one running stream.
        """
        std = self.std(expected_cohort_size)
        for name, t in aggregate.items():
            if not t.is_floating_point():
                raise ValueError(f"aggregate[{name!r}] has dtype {t.dtype}; floating point needed")
        normals, offset = self._take_prepared(aggregate, draw), 0
        out = {}
        for name, t in aggregate.items():
            t = t.detach()
            if _numpy_path(t):
                # x + std * z in float64, z ~ N(0, 1) from NumPy's ziggurat (module docstring)
                if normals is not None:  # the same draws, made while the clients trained
                    count = t.numel()
                    noise = normals[offset : offset + count].reshape(tuple(t.shape))
                    offset += count
                else:
                    noise = self._generator("numpy", draw).standard_normal(tuple(t.shape))
                with np.errstate(over="ignore", invalid="ignore"):  # inf silently, as torch's
                    np.multiply(noise, std, out=noise)
                    np.add(t.numpy(), noise, out=noise)
                    if t.dtype == torch.float32:
                        noise = noise.astype(np.float32)
                out[name] = torch.from_numpy(noise)
                continue
            noise = torch.randn(
                t.shape,
                generator=self._generator(t.device, draw),
                dtype=t.dtype,
                device=t.device,
            )
            out[name] = t + noise.mul_(std)
        return out

    def state_dict(self) -> dict:
        """The public settings (sigma, C, and M when set); never the seed or a generator state."""
        state = {"noise_multiplier": self.noise_multiplier, "clip": self.base_clip}
        if self.noise_cohort_size is not None:
            state["noise_cohort_size"] = self.noise_cohort_size
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Check that a saved state has this mechanism's settings (it restores no randomness).

        Raises ``ValueError`` naming the setting that differs: a resumed run must not change
        the noise scale of a run whose earlier rounds were accounted at the old one.
        """
        own = self.state_dict()
        for key in ("noise_multiplier", "clip"):
            if float(state[key]) != own[key]:
                raise ValueError(
                    f"saved noise state has {key}={state[key]!r} but this mechanism uses "
                    f"{own[key]!r}"
                )
        if state.get("noise_cohort_size") != self.noise_cohort_size:
            raise ValueError(
                f"saved noise state has noise_cohort_size={state.get('noise_cohort_size')!r} "
                f"but this mechanism uses {self.noise_cohort_size!r}"
            )


def _numpy_path(t: torch.Tensor) -> bool:
    """Whether :meth:`GaussianNoise.add` draws ``t``'s noise with NumPy (CPU float32/64)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def noisy_norm_signal(
    aggregate: Mapping[str, torch.Tensor], layout: Layout, *, std: float
) -> dict[str, float]:
    """Unbiased per-group norm signal from the released noisy aggregate.

    ``sqrt(max(0, ||agg_l||^2 - p_l * std^2))``: ``E||x + z||^2 = ||x||^2 + p_l std^2`` for
    ``z ~ N(0, std^2 I_{p_l})``, so subtracting the expected noise energy gives an unbiased
    estimate of ``||x||^2`` (clamped at 0 before the square root). It uses only the released
    aggregate, so feeding it to :class:`EMABudgetState` is post-processing with no privacy cost.
    It estimates the norm of the *mean* clipped update, which is at most the paper's mean of
    client norms (triangle inequality); the two differ most when clients disagree.

    Arguments
    ---------
    aggregate : mapping of str to Tensor
        The noisy mean, keyed by parameter name.
    layout : Layout
        Groups of the aggregate.
    std : float
        The noise std that was added (:func:`noise_std`).

    Returns
    -------
    dict of str to float

    Example
    -------
    >>> from speechbrain_fl.privacy.layout import Group
    >>> lay = Layout([Group("w", "llm", 4)])
    >>> noisy_norm_signal({"w": torch.full((4,), 1.0)}, lay, std=0.5)
    {'w': 1.7320508075688772}
    """
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std must be finite and >= 0, got {std!r}")
    check_names(aggregate.keys(), layout.parameter_names, what="aggregate")
    names = list(layout.parameter_names)
    with torch.no_grad():
        norms = torch._foreach_norm([aggregate[n].detach() for n in names])
        sq = (torch.stack([x.double().cpu() for x in norms]) ** 2).tolist()
    per_param = dict(zip(names, sq, strict=True))
    out = {}
    for g in layout:
        energy = math.fsum(per_param[p] for p in g.parameter_names)
        out[g.name] = math.sqrt(max(0.0, energy - g.numel * std * std))
    return out

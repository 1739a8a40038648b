"""AW-DP: imbalance-aware weighted DP-SGD with a sensitivity bound, on Opacus.

The paper ("Private Speech Classification without Collapse") calls AW-DP a
"minibatch-adaptive bounded loss reweighting" and gives no formula. Weights computed from the
sampled minibatch would let one record change every other record's weight, so the sensitivity
of the noisy sum would no longer be the clip norm ``C`` without a further argument. Our variant
(our choice, documented here) takes the weights from a *privacy-free* source instead:

    w_c = (min_k n_k / n_c) ** gamma,   c = 1..K,   gamma >= 0,

with ``n_c`` the label counts of the public auxiliary set D_aux (or a public class prior), so
``w_c`` lies in (0, 1], the rarest class gets 1 and ``gamma`` (ours, YAML key ``aw_gamma``)
interpolates between no reweighting (0) and full inverse frequency (1). Each record's
*clipped* per-sample gradient is scaled by the weight of its own label:

    g~_i = w_{y_i} * clip(g_i, C),     clip(g, C) = g * min(1, C / ||g||_2),
    G = sum_{i in B} g~_i + N(0, sigma^2 C^2 I).

**Sensitivity bound.** Let D' = D plus one record (x', y'). The weights are fixed before
training from data outside D (D_aux or a prior), so no other record's term changes, and with
Poisson sampling the two sums differ by at most the one term g~' (present or absent):

    || sum_{D'} g~_i - sum_D g~_i ||_2 = || w_{y'} clip(g', C) ||_2 <= w_{y'} C <= C,

because ``||clip(g, C)|| <= C`` and ``w <= 1``. The L2 sensitivity is therefore at most ``C``,
the same as Opacus's unweighted DP-SGD, so adding ``N(0, sigma^2 C^2)`` (Opacus's noise,
unchanged) gives the sampled Gaussian mechanism with multiplier ``sigma`` and Opacus's RDP
accountant applies as is. The bound is tight for the rarest class (w = 1). Labels enter only
through the record's own term, which is what per-record sensitivity allows.

**Batch-adaptive form** (:class:`BatchAdaptiveDPOptimizer`, also our choice). Each class's
clipped gradients are averaged over the class's count in the *sampled* batch, with a floor
``m >= 1`` on that count, and the class means are mixed with fixed coefficients ``a_c >= 0``:

    S(B) = sum_c a_c / max(n_c(B), m) * sum_{i in B, y_i = c} clip(g_i, C),
    G = (S(B) + N(0, sigma^2 Delta^2 I)) / sum_c a_c,
    Delta = C * max_c a_c * 2 / (m + 1).

Proof of the sensitivity ``Delta``. Let B' = B plus one record (x', y' = c) (Poisson
neighbours). Only the term of class c changes. Write n = n_c(B) and s = sum of the n clipped
gradients of class c in B, so ||s|| <= n C and ||clip(g')|| <= C.
(i) n + 1 <= m: both denominators are m and the term changes by a_c clip(g') / m, of norm
<= a_c C / m.
(ii) n >= m: the change is a_c [(s + g') / (n + 1) - s / n] = a_c [g' / (n + 1) - s / (n (n + 1))],
of norm <= a_c (C / (n + 1) + n C / (n (n + 1))) = 2 a_c C / (n + 1) <= 2 a_c C / (m + 1).
For integers n these cases are exhaustive, and 2 / (m + 1) >= 1 / m for m >= 1, so
||S(B') - S(B)|| <= Delta for every B and every added record: removal is the same pair read
the other way. Case (ii) is tight (s = -n g', n = m). The sampled Gaussian mechanism of
Mironov, Talwar and Zhang (2019), which Opacus's RDP accountant evaluates, is defined for any
query of L2 sensitivity Delta on the Poisson-sampled set, with noise sigma * Delta: adding
N(0, sigma^2 Delta^2) makes the accountant's figure for (q, sigma, steps) hold unchanged.
Dividing by the fixed sum_c a_c is post-processing.

What it costs (measured reasoning, not a theorem): with balanced coefficients
``a_c = E|B| / K`` and ``m`` near the expected minority count, Delta is about 2 a / m times C,
i.e. each minority record moves the update ``E|B| / (K m)`` times more than in plain DP-SGD
and the noise grows by that factor; the fixed public weights above keep Delta = C and pay
instead with a smaller signal from the down-weighted classes. Both give the minority the same
share of the update; the fixed form avoids the factor 2 of case (ii), so it is the recipe's
default (``aw_mode``).

Randomness: the Poisson sampler and the Gaussian noise use ``torch.Generator`` objects seeded
from ``os.urandom`` (not from the recipe seed: docs/design.md privacy invariant 1), never written to
disk. A fixed ``noise_seed`` is for tests only and warns. (Opacus's ``secure_mode`` would use a
CSPRNG from ``torchcsprng``, which is not installed here.)

**Opacus internals.** The weighted optimizers re-implement Opacus's ``clip_and_accumulate``
and ``add_noise`` with Opacus's own private helpers (``_check_processed_flag``,
``_mark_as_processed``, ``_generate_noise``, ``DPOptimizer._get_flat_grad_sample``), and
:class:`DPSGDPrivacyEngine` overrides ``PrivacyEngine._prepare_optimizer`` and sets its
``secure_rng`` (the Poisson sampler's generator); the Private-Gender recipe calls
``GradSampleModule._close`` and reads ``GradSampleModule._module``. Opacus's own optimizers
(``DPPerLayerOptimizer``) subclass ``DPOptimizer`` with the same helpers. Opacus's public API has no hook for per-sample weights, so these
are pinned instead: :data:`OPACUS_PRIVATE_API` records each helper with the parameters used,
:func:`check_opacus_private_api` (run when an engine is built, and by the unit tests) raises
naming the helper if one disappears or changes its parameters, and
:meth:`DPSGDPrivacyEngine.make_private` checks that the optimizer and the Poisson sampler it
returns are the ones built here (else a renamed internal would silently give an unweighted
optimizer, or a sampler on the global, seed-derived generator). Tested with
:data:`OPACUS_TESTED`.

Example
-------
>>> class_weights_from_counts([700, 250, 50], gamma=1.0)
tensor([0.0714, 0.2000, 1.0000])
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import warnings
from collections.abc import Sequence

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

__all__ = [
    "OPACUS_PRIVATE_API",
    "OPACUS_TESTED",
    "BatchAdaptiveDPOptimizer",
    "DPSGDPrivacyEngine",
    "WeightedDPOptimizer",
    "batch_adaptive_factors",
    "batch_adaptive_sensitivity",
    "check_opacus_private_api",
    "class_weights_from_counts",
    "os_seeded_generator",
]

logger = logging.getLogger(__name__)

#: The Opacus versions this module's use of Opacus internals was tested with.
OPACUS_TESTED = ">=1.5,<1.7 (1.6.0)"
#: Private Opacus helpers used here (and by the Private-Gender recipe), each with the leading
#: parameters this code relies on, in order.
OPACUS_PRIVATE_API = {
    "opacus.optimizers.optimizer:_check_processed_flag": ("obj",),
    "opacus.optimizers.optimizer:_mark_as_processed": ("obj",),
    "opacus.optimizers.optimizer:_generate_noise": ("std", "reference", "generator", "secure_mode"),
    "opacus.optimizers.optimizer:DPOptimizer._get_flat_grad_sample": ("self", "p"),
    "opacus.privacy_engine:PrivacyEngine._prepare_optimizer": (
        "self",
        "optimizer",
        "noise_multiplier",
        "max_grad_norm",
        "expected_batch_size",
        "loss_reduction",
        "distributed",
        "clipping",
        "noise_generator",
        "grad_sample_mode",
    ),
    "opacus.grad_sample.grad_sample_module:GradSampleModule._close": ("self",),
}


def check_opacus_private_api(api: dict[str, tuple[str, ...]] | None = None) -> None:
    """Raise ``RuntimeError`` naming every helper of ``api`` that is missing or changed.

    Arguments
    ---------
    api : dict, optional
        ``{"module:attribute.path": (parameter names, in order)}``; default
        :data:`OPACUS_PRIVATE_API`.

    Example
    -------
    >>> check_opacus_private_api()  # the installed Opacus has every helper this module uses
    """
    import opacus

    problems = []
    for where, expected in (OPACUS_PRIVATE_API if api is None else api).items():
        module_name, attribute = where.split(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attribute.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            problems.append(f"{where} is gone")
            continue
        names = tuple(inspect.signature(obj).parameters)[: len(expected)]
        if names != expected:
            problems.append(f"{where} takes {names}, this code passes {expected}")
    if problems:
        raise RuntimeError(
            f"opacus {opacus.__version__}: private helpers used by "
            f"speechbrain_fl.privacy.weighted_dpsgd changed ({'; '.join(problems)}); it was "
            f"tested with opacus{OPACUS_TESTED}: install that version or update this module"
        )


def class_weights_from_counts(counts: Sequence[float], *, gamma: float = 1.0) -> torch.Tensor:
    """AW-DP class weights ``(min_k n_k / n_c) ** gamma`` in (0, 1] (module docstring).

    Arguments
    ---------
    counts : sequence of float
        Per-class counts (or shares) from a privacy-free source; all must be > 0.
    gamma : float
        Exponent >= 0 (0: all weights 1; 1: inverse class frequency).

    Returns
    -------
    torch.Tensor
        float32 weights, shape (K,).

    Example
    -------
    >>> class_weights_from_counts([0.5, 0.5]).tolist()
    [1.0, 1.0]
    """
    counts = torch.as_tensor(list(counts), dtype=torch.float64)
    if counts.ndim != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty 1-D sequence, got {counts.tolist()}")
    zero = torch.nonzero(~(counts > 0)).flatten().tolist()
    if zero:
        raise ValueError(
            f"class index(es) {zero} have count <= 0: no AW-DP weight (counts "
            f"{counts.tolist()}); the weight source must contain every class"
        )
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return ((counts.min() / counts) ** float(gamma)).to(torch.float32)


def os_seeded_generator(seed: int | None = None, *, what: str = "DP-SGD") -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``os.urandom`` (or from ``seed``, with a warning)."""
    gen = torch.Generator()
    if seed is None:
        gen.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    else:
        msg = f"{what}: fixed seed {seed} for sampling/noise; for testing only, not private"
        logger.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)
        gen.manual_seed(int(seed))
    return gen


class WeightedDPOptimizer(DPOptimizer):
    """Opacus ``DPOptimizer`` whose clipped per-sample gradients are scaled by class weights.

    Call :meth:`set_labels` with the batch's labels before ``step()``; the weight of record
    ``i`` is ``class_weights[labels[i]]``. Everything else (noise ``N(0, (sigma C)^2)`` on the
    sum, division by the expected batch size, accountant hook) is Opacus's. The sensitivity
    proof is in the module docstring; ``class_weights`` must lie in (0, 1].

    Example
    -------
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = WeightedDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...     noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=2,
    ...     class_weights=torch.tensor([0.5, 1.0]))
    >>> opt.class_weights.tolist()
    [0.5, 1.0]
    """

    def __init__(self, optimizer, *, class_weights: torch.Tensor, **kwargs):
        super().__init__(optimizer, **kwargs)
        weights = torch.as_tensor(class_weights, dtype=torch.float32).flatten()
        if weights.numel() == 0 or not bool(((weights > 0) & (weights <= 1)).all()):
            raise ValueError(f"class_weights must lie in (0, 1], got {weights.tolist()}")
        self.class_weights = weights
        self._labels: torch.Tensor | None = None

    def set_labels(self, labels: torch.Tensor) -> None:
        """Labels of the current (Poisson-sampled) batch, in batch order."""
        labels = torch.as_tensor(labels).long().flatten()
        if labels.numel() and (labels.min() < 0 or labels.max() >= self.class_weights.numel()):
            raise ValueError(
                f"labels outside [0, {self.class_weights.numel()}): {sorted(set(labels.tolist()))}"
            )
        self._labels = labels

    def per_sample_weights(self, batch_size: int) -> torch.Tensor:
        if self._labels is None or self._labels.numel() != batch_size:
            raise RuntimeError(
                f"WeightedDPOptimizer: set_labels() must be called with the {batch_size} labels "
                f"of the batch before step() (got {None if self._labels is None else self._labels.numel()})"
            )
        return self.class_weights[self._labels]

    def clip_and_accumulate(self):
        """sum_i w_{y_i} * clip(g_i, C) into ``p.summed_grad`` (module docstring)."""
        batch_size = len(self.grad_samples[0])
        if batch_size == 0:
            factor = torch.zeros((0,), device=self.grad_samples[0].device)
        else:
            norms = torch.stack(
                [g.reshape(batch_size, -1).norm(2, dim=-1) for g in self.grad_samples], dim=1
            ).norm(2, dim=1)
            clip = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            factor = clip * self.per_sample_weights(batch_size).to(clip.device)
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            grad_sample = self._get_flat_grad_sample(p).to(p.dtype)
            grad = torch.einsum("i,i...", factor.to(grad_sample.device, p.dtype), grad_sample)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)
        self._labels = None


def batch_adaptive_factors(
    labels: torch.Tensor, *, coefficients: torch.Tensor, floor: int
) -> torch.Tensor:
    """Per-record multipliers ``a_{y_i} / max(n_{y_i}(B), m)`` of the batch-adaptive form.

    Example
    -------
    >>> batch_adaptive_factors(torch.tensor([0, 0, 0, 1]), coefficients=torch.tensor([3.0, 2.0]),
    ...                        floor=2).tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    labels = torch.as_tensor(labels).long().flatten()
    coefficients = torch.as_tensor(coefficients, dtype=torch.float32).flatten()
    counts = torch.bincount(labels, minlength=coefficients.numel()).to(torch.float32)
    return coefficients[labels] / counts.clamp(min=float(floor))[labels]


def batch_adaptive_sensitivity(*, clip: float, coefficients, floor: int) -> float:
    """``Delta = C * max_c a_c * 2 / (m + 1)`` (proof in the module docstring).

    Example
    -------
    >>> batch_adaptive_sensitivity(clip=1.0, coefficients=[3.0, 3.0], floor=2)
    2.0
    """
    a = torch.as_tensor(coefficients, dtype=torch.float64).flatten()
    if a.numel() == 0 or not bool((a >= 0).all()) or not float(a.max()) > 0:
        raise ValueError(f"coefficients must be >= 0 with one > 0, got {a.tolist()}")
    if int(floor) != floor or floor < 1:
        raise ValueError(f"floor m must be an integer >= 1, got {floor}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    return float(clip) * float(a.max()) * 2.0 / (int(floor) + 1)


class BatchAdaptiveDPOptimizer(WeightedDPOptimizer):
    """Opacus ``DPOptimizer`` for the batch-adaptive AW-DP form (module docstring).

    Per-record multipliers ``a_{y_i} / max(n_{y_i}(B), m)`` from the sampled batch's labels
    (:meth:`set_labels` before ``step()``), Gaussian noise of std ``sigma * Delta`` with
    ``Delta`` = :func:`batch_adaptive_sensitivity`, and division by the fixed ``sum_c a_c``
    (Opacus's ``expected_batch_size`` is replaced by it; use ``loss_reduction="sum"`` in the
    model, or Opacus's "mean", whose per-sample gradients are rescaled before clipping either
    way). The noise multiplier ``sigma`` is the accountant's, unchanged.

    Example
    -------
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = BatchAdaptiveDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...     noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8,
    ...     coefficients=torch.tensor([4.0, 4.0]), floor=3)
    >>> opt.sensitivity, opt.expected_batch_size
    (2.0, 8.0)
    """

    def __init__(self, optimizer, *, coefficients: torch.Tensor, floor: int, **kwargs):
        a = torch.as_tensor(coefficients, dtype=torch.float32).flatten()
        kwargs["expected_batch_size"] = float(a.sum())
        super().__init__(optimizer, class_weights=torch.ones_like(a), **kwargs)
        self.coefficients = a
        self.floor = int(floor)
        self.sensitivity = batch_adaptive_sensitivity(
            clip=self.max_grad_norm, coefficients=a, floor=self.floor
        )

    def per_sample_weights(self, batch_size: int) -> torch.Tensor:
        super().per_sample_weights(batch_size)  # checks that the labels were set
        return batch_adaptive_factors(
            self._labels, coefficients=self.coefficients, floor=self.floor
        )

    def add_noise(self):
        """``p.grad = S + N(0, (sigma * Delta)^2)`` (Opacus's noise source, its std replaced)."""
        from opacus.optimizers.optimizer import _generate_noise

        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(
                std=self.noise_multiplier * self.sensitivity,
                reference=p.summed_grad,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)


class DPSGDPrivacyEngine(PrivacyEngine):
    """Opacus ``PrivacyEngine`` with OS-seeded sampling/noise and optional AW-DP weights.

    Arguments
    ---------
    accountant : str
        Opacus accountant (``"rdp"``).
    class_weights : torch.Tensor, optional
        Fixed AW-DP weights in (0, 1]; the optimizer returned by ``make_private`` is then a
        :class:`WeightedDPOptimizer` (``grad_sample_mode="hooks"`` only).
    batch_adaptive : dict, optional
        ``{"coefficients": a, "floor": m}``: the batch-adaptive form instead
        (:class:`BatchAdaptiveDPOptimizer`); exclusive with ``class_weights``.
    seed : int, optional
        Fixed seed of the Poisson sampler and the noise: tests only (warns).

    Example
    -------
    >>> engine = DPSGDPrivacyEngine(accountant="rdp")
    >>> engine.accountant.mechanism()
    'rdp'
    """

    def __init__(
        self,
        *,
        accountant: str = "rdp",
        class_weights=None,
        batch_adaptive: dict | None = None,
        seed: int | None = None,
    ):
        check_opacus_private_api()
        super().__init__(accountant=accountant, secure_mode=False)
        if class_weights is not None and batch_adaptive is not None:
            raise ValueError("class_weights and batch_adaptive are exclusive AW-DP forms")
        self.class_weights = class_weights
        self.batch_adaptive = batch_adaptive
        # Opacus draws the Poisson batches from ``secure_rng``; ``sampling_rng`` keeps our
        # generator to check that it did (make_private).
        self.sampling_rng = os_seeded_generator(seed, what="Poisson sampling")
        self.secure_rng = self.sampling_rng
        self.noise_rng = os_seeded_generator(None if seed is None else seed + 1, what="DP noise")
        self.fixed_seed = seed

    def make_private(self, **kwargs):
        """Opacus's ``make_private``, then a check that its internals used what was set here.

        Raises ``RuntimeError`` if the Poisson sampler does not draw from this engine's
        OS-seeded generator, or the optimizer is not the AW-DP one asked for.
        """
        module, optimizer, loader = super().make_private(**kwargs)
        sampler = getattr(loader, "batch_sampler", None)
        if kwargs.get("poisson_sampling", True) and (
            getattr(sampler, "generator", None) is not self.sampling_rng
        ):
            raise RuntimeError(
                "opacus's Poisson sampler does not use the engine's OS-seeded generator (an Opacus "
                f"internal changed; tested with opacus{OPACUS_TESTED}): refusing to train on a "
                "generator that may derive from the recipe seed"
            )
        wanted = (
            BatchAdaptiveDPOptimizer
            if self.batch_adaptive is not None
            else WeightedDPOptimizer
            if self.class_weights is not None
            else DPOptimizer
        )
        if not isinstance(optimizer, wanted):
            raise RuntimeError(
                f"opacus built a {type(optimizer).__name__}, not the {wanted.__name__} asked for "
                f"(PrivacyEngine._prepare_optimizer changed; tested with opacus{OPACUS_TESTED})"
            )
        return module, optimizer, loader

    def _prepare_optimizer(
        self,
        *,
        optimizer,
        grad_sample_mode="hooks",
        clipping="flat",
        distributed=False,
        noise_generator=None,
        **kwargs,
    ):
        if self.class_weights is None and self.batch_adaptive is None:
            return super()._prepare_optimizer(
                optimizer=optimizer,
                grad_sample_mode=grad_sample_mode,
                clipping=clipping,
                distributed=distributed,
                noise_generator=noise_generator or self.noise_rng,
                **kwargs,
            )
        if grad_sample_mode != "hooks" or clipping != "flat" or distributed:
            raise ValueError(
                "AW-DP weights need grad_sample_mode='hooks', flat clipping and a "
                f"single process (got {grad_sample_mode!r}, {clipping!r})"
            )
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        common = {"generator": noise_generator or self.noise_rng, "secure_mode": False, **kwargs}
        if self.batch_adaptive is not None:
            return BatchAdaptiveDPOptimizer(
                optimizer,
                coefficients=self.batch_adaptive["coefficients"],
                floor=self.batch_adaptive["floor"],
                **common,
            )
        return WeightedDPOptimizer(optimizer, class_weights=self.class_weights, **common)

"""AW-DP: imbalance-aware weighted DP-SGD with a sensitivity bound, on Opacus.

The paper ("Private Speech Classification without Collapse", ``shared/papers``) calls AW-DP a
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
through the record's own term, which is what per-record sensitivity allows. A batch-adaptive
form is not implemented.

Randomness: the Poisson sampler and the Gaussian noise use ``torch.Generator`` objects seeded
from ``os.urandom`` (not from the recipe seed: DESIGN.md privacy invariant 1), never written to
disk. A fixed ``noise_seed`` is for tests only and warns. (Opacus's ``secure_mode`` would use a
CSPRNG from ``torchcsprng``, which is not installed here.)

Example
-------
>>> class_weights_from_counts([700, 250, 50], gamma=1.0)
tensor([0.0714, 0.2000, 1.0000])
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

__all__ = [
    "DPSGDPrivacyEngine",
    "WeightedDPOptimizer",
    "class_weights_from_counts",
    "os_seeded_generator",
]

logger = logging.getLogger(__name__)


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
        raise ValueError(f"class index(es) {zero} have count <= 0: no AW-DP weight (counts "
                         f"{counts.tolist()}); the weight source must contain every class")  # fmt: skip
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
            raise ValueError(f"labels outside [0, {self.class_weights.numel()}): "
                             f"{sorted(set(labels.tolist()))}")  # fmt: skip
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


class DPSGDPrivacyEngine(PrivacyEngine):
    """Opacus ``PrivacyEngine`` with OS-seeded sampling/noise and optional AW-DP weights.

    Arguments
    ---------
    accountant : str
        Opacus accountant (``"rdp"``).
    class_weights : torch.Tensor, optional
        AW-DP weights in (0, 1]; the optimizer returned by ``make_private`` is then a
        :class:`WeightedDPOptimizer` (``grad_sample_mode="hooks"`` only).
    seed : int, optional
        Fixed seed of the Poisson sampler and the noise: tests only (warns).

    Example
    -------
    >>> engine = DPSGDPrivacyEngine(accountant="rdp")
    >>> engine.accountant.mechanism()
    'rdp'
    """

    def __init__(self, *, accountant: str = "rdp", class_weights=None, seed: int | None = None):
        super().__init__(accountant=accountant, secure_mode=False)
        self.class_weights = class_weights
        self.secure_rng = os_seeded_generator(seed, what="Poisson sampling")
        self.noise_rng = os_seeded_generator(None if seed is None else seed + 1, what="DP noise")
        self.fixed_seed = seed

    def _prepare_optimizer(self, *, optimizer, grad_sample_mode="hooks", clipping="flat",
                           distributed=False, noise_generator=None, **kwargs):  # fmt: skip
        if self.class_weights is None:
            return super()._prepare_optimizer(
                optimizer=optimizer, grad_sample_mode=grad_sample_mode, clipping=clipping,
                distributed=distributed, noise_generator=noise_generator or self.noise_rng,
                **kwargs,
            )  # fmt: skip
        if grad_sample_mode != "hooks" or clipping != "flat" or distributed:
            raise ValueError("AW-DP weights need grad_sample_mode='hooks', flat clipping and a "
                             f"single process (got {grad_sample_mode!r}, {clipping!r})")  # fmt: skip
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        return WeightedDPOptimizer(
            optimizer,
            class_weights=self.class_weights,
            generator=noise_generator or self.noise_rng,
            secure_mode=False,
            **kwargs,
        )

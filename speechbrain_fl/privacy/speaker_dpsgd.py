"""Speaker-level (user-level) DP-SGD on Opacus's per-sample gradients.

Clip-level DP-SGD protects one record; a speaker with ``k`` clips is then protected only at
group level ``k``. User-level DP-SGD (McMahan et al. 2018, "Learning differentially private
recurrent language models"; the unit of pfl-research and of production federated training)
protects a speaker's *whole* contribution instead. One step, with ``S`` the speakers of the
private set, ``q`` the speaker sampling rate, ``C`` the clip and ``sigma`` the noise multiplier:

    B_t ~ Poisson(S, q)                               each speaker kept with probability q
    u_s = (1 / n_s) sum_{i in s} g_i                  mean of the per-clip gradients of s
                                                      (or their sum: ``reduction="sum"``)
    G_t = ( sum_{s in B_t} w_s clip(u_s, C) + N(0, sigma^2 C^2 I) ) / (q |S|),

``g_i = grad_theta CE(f(x_i), y_i)`` from Opacus's :class:`~opacus.GradSampleModule`,
``clip(u, C) = u min(1, C / ||u||_2)``, ``n_s`` the clips of ``s`` (all of them: every clip of
a sampled speaker trains) and ``w_s`` in (0, 1] the AW-DP weight of the speaker (below; 1
without AW-DP). The divisor ``q |S|`` is the expected number of sampled speakers, fixed, so it
is post-processing.

**Mean or sum** (``reduction``). With ``"mean"`` (the default) ``u_s`` is the mean over the
speaker's clips, so its norm is on the scale of one clip's gradient whatever ``n_s`` is and the
same ``C`` fits both units; but the mean of ``n_s`` partly disagreeing gradients is shorter
than one clip's, so a speaker whose mean stays below ``C`` contributes less than one clipped
clip would. With ``"sum"``, ``u_s = sum_{i in s} g_i``: its norm grows with ``n_s``, so a
many-clip speaker is clipped to ``C`` like one clip, and a speaker with few clips or small
gradients keeps its whole contribution. Both give sensitivity ``C`` (the bound below does not
use how ``u_s`` is formed from the speaker's own clips), hence the same noise and epsilon.

**Sensitivity bound.** Let S' = S plus one speaker s' with any number of clips. The other
speakers' terms do not depend on s' (their means use only their own clips, their weights are
public), so with Poisson sampling the two sums differ by the single term of s', present or not:

    || sum_{S'} w_s clip(u_s, C) - sum_S w_s clip(u_s, C) || = w_{s'} ||clip(u_{s'}, C)||
                                                             <= w_{s'} C <= C.

Adding ``N(0, sigma^2 C^2 I)`` is then the sampled Gaussian mechanism with rate ``q`` over
speakers, and ``T`` steps compose exactly as for clip-level DP-SGD: the accountant's figure for
``(q, sigma, T)`` (PLD, Opacus's RDP or PRV) is an (epsilon, delta) guarantee for adding or
removing one *speaker*, all of their clips together.

**AW-DP composes** (:mod:`.weighted_dpsgd`, fixed form). The class weights ``w_c`` come from a
privacy-free source and lie in (0, 1]; the speaker's weight is the mean of its clips' weights,
``w_s = (1 / n_s) sum_{i in s} w_{y_i}`` (``w_{y}`` for a speaker whose clips share a label),
applied to the *clipped* speaker mean exactly as the clip-level form weights a clipped
per-sample gradient, so the bound above stays ``C``. The batch-adaptive form is not offered:
its proof counts records of a class in the batch, and one speaker moves several counts.

**Why hand-written.** Opacus's ``DPOptimizer`` clips each *row* of ``grad_sample`` and its data
loader samples *rows*; it has no notion of a group of rows that belongs to one person, so the
grouping (:func:`speaker_clipped_sum`) and the speaker sampler (:class:`SpeakerPoissonSampler`)
are written here. Everything else is Opacus's or the project's: the per-clip gradients
(``GradSampleModule``), the noise source (``_generate_noise``, pinned in
:data:`.weighted_dpsgd.OPACUS_PRIVATE_API`), the accountant that counts the steps (Opacus's
``create_accountant``, whose history ``(sigma, q, T)`` the reports compose) and the sigma
search (:func:`~speechbrain_fl.privacy.accounting.noise_multiplier_for_epsilon`).

Randomness: the speaker sampler and the noise draw from generators seeded from ``os.urandom``
(:func:`.weighted_dpsgd.os_seeded_generator`); a fixed seed is for tests only and warns.

Example
-------
>>> g = [torch.tensor([[3.0], [5.0], [1.0]])]          # three clips, one parameter
>>> speaker_clipped_sum(g, torch.tensor([0, 0, 1]), clip=2.0)[0]   # means 4 -> 2, 1 -> 1
tensor([3.0000])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .weighted_dpsgd import check_opacus_private_api, os_seeded_generator

__all__ = ["REDUCTIONS", "SpeakerDPOptimizer", "SpeakerPoissonSampler", "speaker_clipped_sum"]

#: How a speaker's per-clip gradients form the vector that is clipped (module docstring).
REDUCTIONS = ("mean", "sum")

logger = logging.getLogger(__name__)


def speaker_clipped_sum(
    grad_samples: Sequence[torch.Tensor],
    groups: torch.Tensor,
    *,
    clip: float,
    clip_weights: torch.Tensor | None = None,
    reduction: str = "mean",
) -> list[torch.Tensor]:
    """``sum_s w_s clip(u_s, C)`` with ``u_s`` the mean (or sum) of the rows of group ``s``
    (module doc).

    Arguments
    ---------
    grad_samples : sequence of torch.Tensor
        Per-clip gradients, one tensor ``(B, *shape)`` per parameter (Opacus's ``grad_sample``).
    groups : torch.Tensor
        ``(B,)`` speaker index of each row, in ``0..k-1``.
    clip : float
        ``C`` > 0, applied to each speaker's mean over all parameters together (flat clipping).
    clip_weights : torch.Tensor, optional
        ``(B,)`` per-clip weights in (0, 1] (AW-DP ``w_{y_i}``); a speaker's weight is their mean.
    reduction : str
        ``"mean"``: ``u_s = (1 / n_s) sum_{i in s} g_i``; ``"sum"``: ``u_s = sum_{i in s} g_i``.

    Returns
    -------
    list of torch.Tensor
        One summed gradient per parameter, of the parameter's shape.
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    groups = torch.as_tensor(groups, dtype=torch.long).flatten()
    rows = groups.numel()
    if any(g.shape[0] != rows for g in grad_samples):
        raise ValueError(
            f"groups has {rows} rows, grad_samples {[g.shape[0] for g in grad_samples]}"
        )
    if rows == 0:
        return [torch.zeros(g.shape[1:], dtype=g.dtype, device=g.device) for g in grad_samples]
    k = int(groups.max()) + 1
    counts = torch.bincount(groups, minlength=k).to(grad_samples[0].dtype)
    if bool((counts == 0).any()):
        raise ValueError("groups must number the speakers 0..k-1 without gaps")
    means = []
    for g in grad_samples:
        flat = g.reshape(rows, -1)
        total = torch.zeros(k, flat.shape[1], dtype=flat.dtype, device=flat.device)
        total.index_add_(0, groups, flat)
        means.append(total / counts[:, None] if reduction == "mean" else total)
    norms = torch.cat(means, dim=1).norm(2, dim=1)
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    if clip_weights is not None:
        w = torch.as_tensor(clip_weights, dtype=factor.dtype).flatten()
        if w.numel() != rows or not bool(((w > 0) & (w <= 1)).all()):
            raise ValueError(f"clip_weights must be {rows} values in (0, 1]")
        factor = factor * torch.zeros(k, dtype=w.dtype).index_add_(0, groups, w) / counts
    return [
        (factor[:, None] * m).sum(0).reshape(g.shape[1:])
        for m, g in zip(means, grad_samples, strict=False)
    ]


class SpeakerPoissonSampler:
    """Poisson sampling of speakers: each step keeps each speaker with probability ``q``.

    Iterating gives ``steps`` index tensors: the clips (rows of the private set) of every
    sampled speaker, all of them; :attr:`groups` then holds the speaker index ``0..k-1`` of
    each returned clip (the layout :func:`speaker_clipped_sum` takes).

    Arguments
    ---------
    speakers : sequence of str
        Speaker id of each clip of the private set.
    sampling_rate : float
        ``q`` in (0, 1].
    steps : int
        Draws per pass (one epoch).
    generator : torch.Generator
        OS-seeded (:func:`~speechbrain_fl.privacy.weighted_dpsgd.os_seeded_generator`).

    Example
    -------
    >>> s = SpeakerPoissonSampler(["a", "b", "a"], sampling_rate=1.0, steps=1,
    ...                           generator=torch.Generator().manual_seed(0))
    >>> [idx.tolist() for idx in s], s.groups.tolist()
    ([[0, 2, 1]], [0, 0, 1])
    """

    def __init__(
        self, speakers: Sequence[str], *, sampling_rate: float, steps: int, generator
    ) -> None:
        if not 0.0 < sampling_rate <= 1.0:
            raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate}")
        members: dict[str, list[int]] = {}
        for i, spk in enumerate(speakers):
            members.setdefault(str(spk), []).append(i)
        if not members:
            raise ValueError("no speakers: the private set is empty")
        self.members = [torch.tensor(v, dtype=torch.long) for v in members.values()]
        self.sampling_rate = float(sampling_rate)
        self.steps = int(steps)
        self.generator = generator
        self.groups = torch.zeros(0, dtype=torch.long)

    @property
    def num_speakers(self) -> int:
        return len(self.members)

    def __len__(self) -> int:
        return self.steps

    def draw(self) -> torch.Tensor:
        """One Poisson draw: the clip indices of the sampled speakers (sets :attr:`groups`)."""
        keep = torch.rand(self.num_speakers, generator=self.generator) < self.sampling_rate
        chosen = [self.members[s] for s in torch.nonzero(keep).flatten().tolist()]
        if not chosen:
            self.groups = torch.zeros(0, dtype=torch.long)
            return torch.zeros(0, dtype=torch.long)
        self.groups = torch.cat(
            [torch.full((m.numel(),), k, dtype=torch.long) for k, m in enumerate(chosen)]
        )
        return torch.cat(chosen)

    def __iter__(self):
        for _ in range(self.steps):
            yield self.draw()


class SpeakerDPOptimizer:
    """Speaker-level DP-SGD step around a torch optimizer (module docstring).

    Use with a ``GradSampleModule`` (per-clip gradients in ``p.grad_sample``, ``loss_reduction``
    matching the loss) and a :class:`SpeakerPoissonSampler`: after ``loss.backward()`` on the
    clips of the latest draw, :meth:`step` forms ``G_t`` from the sampler's :attr:`groups`,
    writes it to ``p.grad``, steps the wrapped optimizer and records ``(sigma, q)`` in the
    accountant. Rows of ``grad_sample`` beyond the draw's clips (gradient canaries) count as
    one speaker each. :meth:`set_labels` (with ``class_weights``) gives the AW-DP weights.

    Arguments
    ---------
    optimizer : torch.optim.Optimizer
        The optimizer of the module's parameters (the YAML's ``opt_class``).
    params : sequence of torch.nn.Parameter
        The trainable parameters (their ``grad_sample``).
    sampler : SpeakerPoissonSampler
        The speaker sampler; its rate and speaker count fix ``q`` and ``q |S|``.
    noise_multiplier, clip : float
        ``sigma`` and ``C``.
    accountant : str
        Opacus accountant that counts the steps (``"rdp"`` or ``"prv"``).
    class_weights : torch.Tensor, optional
        Fixed AW-DP weights in (0, 1].
    reduction : str
        ``"mean"`` or ``"sum"`` of a speaker's per-clip gradients before the clip.
    noise_generator : torch.Generator
        OS-seeded generator of the noise.
    """

    def __init__(
        self,
        optimizer,
        *,
        params: Sequence[torch.nn.Parameter],
        sampler: SpeakerPoissonSampler,
        noise_multiplier: float,
        clip: float,
        accountant: str = "rdp",
        class_weights: torch.Tensor | None = None,
        reduction: str = "mean",
        noise_generator: torch.Generator | None = None,
    ) -> None:
        from opacus.accountants import create_accountant

        check_opacus_private_api()
        if not noise_multiplier >= 0 or not clip > 0:
            raise ValueError(
                f"need noise_multiplier >= 0 and clip > 0, got {noise_multiplier}, {clip}"
            )
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.sampler = sampler
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(clip)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.expected_speakers = sampler.sampling_rate * sampler.num_speakers
        self.class_weights = None if class_weights is None else torch.as_tensor(class_weights)
        self.generator = noise_generator or os_seeded_generator(what="speaker-level DP noise")
        self.accountant = create_accountant(mechanism=accountant)
        self._labels: torch.Tensor | None = None

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad_sample = None

    def set_labels(self, labels: torch.Tensor) -> None:
        """Labels of the rows of ``grad_sample`` (AW-DP weights ``w_{y_i}``)."""
        self._labels = torch.as_tensor(labels).long().flatten()

    def _rows(self) -> list[torch.Tensor]:
        rows = []
        for p in self.params:
            g = getattr(p, "grad_sample", None)
            if isinstance(g, list):
                g = torch.cat(g, dim=0)
            rows.append(torch.zeros((0, *p.shape), dtype=p.dtype) if g is None else g)
        return rows

    def noisy_gradient(self) -> list[torch.Tensor]:
        """``G_t`` of the module docstring, one tensor per parameter."""
        from opacus.optimizers.optimizer import _generate_noise

        rows = self._rows()
        n = rows[0].shape[0]
        groups = self.sampler.groups
        extra = n - groups.numel()
        if extra < 0:
            raise RuntimeError(f"{n} per-clip gradients for {groups.numel()} sampled clips")
        first = int(groups.max()) + 1 if groups.numel() else 0
        groups = torch.cat([groups, torch.arange(first, first + extra)])
        weights = None
        if self.class_weights is not None:
            if self._labels is None or self._labels.numel() != n:
                raise RuntimeError(f"set_labels() must give the {n} labels before step()")
            weights = self.class_weights[self._labels]
        summed = speaker_clipped_sum(
            rows, groups, clip=self.max_grad_norm, clip_weights=weights, reduction=self.reduction
        )
        out = []
        for s in summed:
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=s,
                generator=self.generator,
                secure_mode=False,
            )
            out.append((s + noise) / self.expected_speakers)
        return out

    def step(self) -> None:
        """Write ``G_t`` to ``p.grad``, step the optimizer, count the step."""
        for p, g in zip(self.params, self.noisy_gradient(), strict=False):
            p.grad = g.to(p.dtype).view_as(p)
        self.optimizer.step()
        self.accountant.step(
            noise_multiplier=self.noise_multiplier, sample_rate=self.sampler.sampling_rate
        )
        self._labels = None

    def get_epsilon(self, delta: float) -> float:
        """The accountant's epsilon after the steps taken (per speaker)."""
        return float(self.accountant.get_epsilon(delta=delta))

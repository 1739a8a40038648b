"""Canary audit of Opacus's DP-SGD: gradient canaries in the same training run.

The DP-SGD counterpart of the federated audit (:mod:`.audit`), after Steinke, Nasr and
Jagielski (NeurIPS 2023, "Privacy auditing with one (1) training run", Sec. 6, gradient-space
canaries in the white-box setting): ``m`` canary *examples* whose per-sample gradient is a
fixed random direction ``d_i`` of norm ``C`` (the clip bound, the worst case clipping allows).
Each canary is included in the training set independently with probability 1/2 (OS randomness,
kept in memory); an included canary is Poisson-sampled into each batch with the run's rate
``q``, like a real example, and its gradient joins the batch's per-sample gradients *before*
Opacus clips, sums and noises them (:meth:`GradientCanaries.insert`, called between
``loss.backward()`` and ``optimizer.step()``). Scores: the cosine of the parameter change
``theta_0 - theta_T`` (descent moves against the gradient) with each ``d_i``; the one-shot
estimate and the one-run lower bound of :mod:`.audit` follow, beside Opacus's epsilon.

Valid for plain SGD (the parameter change is ``-lr`` times the sum of the noisy gradients);
with momentum or adaptive optimisers the cosine is still a valid score (the lower bound holds
for any score) but has less power. What it does not show: see :data:`.audit.AUDIT_NOTE`; the
canaries are not training examples of any person. The Private-Gender teacher's wiring is for a
later session: this module is the tested function it will call.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from .audit import AUDIT_NOTE, CanarySet, one_run_lower_bound, one_shot_epsilon

__all__ = ["GradientCanaries"]


class GradientCanaries:
    """Gradient canaries for an Opacus ``DPOptimizer`` (with ``GradSampleModule`` grads).

    Arguments
    ---------
    named_parameters : iterable of (str, Parameter)
        The trainable parameters the optimiser updates (their ``grad_sample`` receives rows).
    num_canaries : int
        ``m`` >= 2.
    clip : float
        The optimiser's ``max_grad_norm`` ``C``: every canary gradient has norm ``C``.
    sampling_rate : float
        Poisson rate ``q`` of an included canary per step (the data loader's).
    seed : int, optional
        Tests only; ``None`` (default) draws directions, split and per-step draws from the OS.

    Example
    -------
    >>> model = torch.nn.Linear(8, 1)
    >>> canaries = GradientCanaries(model.named_parameters(), 16, clip=1.0, sampling_rate=0.5,
    ...                             seed=0)
    >>> len(canaries.canaries.inserted) + len(canaries.canaries.held_out)
    16
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        num_canaries: int,
        *,
        clip: float,
        sampling_rate: float,
        seed: int | None = None,
    ) -> None:
        params = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters to insert canary gradients into")
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip must be finite and > 0, got {clip!r}")
        if not 0.0 < sampling_rate <= 1.0:
            raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate!r}")
        self.params = dict(params)
        self.clip = float(clip)
        self.sampling_rate = float(sampling_rate)
        self.canaries = CanarySet(num_canaries, {n: tuple(p.shape) for n, p in params}, seed=seed)
        self._rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed + 1)
        self._start = {n: p.detach().to(torch.float64).clone() for n, p in params}
        self.steps = 0
        self.insertions = 0

    def insert(self) -> int:
        """Append this step's Poisson-drawn canary gradients to every ``p.grad_sample``.

        Call after ``loss.backward()`` (Opacus's hooks filled ``grad_sample``) and before
        ``optimizer.step()`` (which clips, sums, noises). Returns the canaries inserted.
        """
        drawn = [i for i in self.canaries.inserted if self._rng.random() < self.sampling_rate]
        self.steps += 1
        if not drawn:
            return 0
        rows = [self.canaries.update(i, self.clip) for i in drawn]
        for name, p in self.params.items():
            sample = getattr(p, "grad_sample", None)
            if isinstance(sample, list):
                sample = torch.cat(sample, dim=0)
            if sample is None:
                raise RuntimeError(
                    f"{name}: no grad_sample; call insert() after loss.backward() on a "
                    "GradSampleModule (Opacus's make_private)"
                )
            extra = torch.stack([r[name] for r in rows]).to(sample.dtype).to(sample.device)
            p.grad_sample = torch.cat([sample, extra], dim=0)
        self.insertions += len(drawn)
        return len(drawn)

    def audit(self, *, delta: float, accountant_epsilon: float, confidence: float = 0.95) -> dict:
        """Score the canaries against ``theta_0 - theta_T`` and bound epsilon.

        Returns
        -------
        dict
            ``epsilon_one_shot``, ``epsilon_lower_bound``, ``confidence``,
            ``accountant_epsilon``, ``exceeds_accountant``, ``canaries``, ``inserted``,
            ``steps``, ``insertions``, ``note``.
        """
        descent: Mapping[str, torch.Tensor] = {
            n: self._start[n] - p.detach().to(torch.float64) for n, p in self.params.items()
        }
        cos = self.canaries.cosines(descent)
        member = self.canaries.is_inserted
        est = one_shot_epsilon(cos[member], cos[~member], delta=delta)
        bound = one_run_lower_bound(cos, member, delta=delta, confidence=confidence)
        audited = [x for x in (est, bound["epsilon"]) if x is not None]
        return {
            "canaries": self.canaries.num_canaries,
            "inserted": int(member.sum()),
            "steps": self.steps,
            "insertions": self.insertions,
            "epsilon_one_shot": est,
            "epsilon_lower_bound": bound["epsilon"],
            "confidence": confidence,
            "accountant_epsilon": accountant_epsilon,
            "exceeds_accountant": any(x > accountant_epsilon for x in audited),
            "note": AUDIT_NOTE.replace("canary clients", "gradient canaries").replace(
                "then sampled like a client", "then Poisson-sampled like an example"
            ),
        }

"""Speaker-level DP-SGD wiring of :func:`speechbrain_fl.distill.dp_training.train_model`
(``privacy_unit: speaker``): speakers Poisson-sampled at rate ``q``, each sampled speaker's mean
(or summed) per-clip gradient clipped to ``C``, Gaussian noise ``sigma C`` on the sum over
speakers (:mod:`speechbrain_fl.privacy.speaker_dpsgd`).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import logging

import torch

from speechbrain_fl.distill.dp_training import _Private, check_delta, sigma_for

logger = logging.getLogger(__name__)

__all__ = ["make_speaker_private"]


class _SpeakerBatches:
    """The private set's batches drawn by a speaker sampler: each iteration yields, per step,
    ``(feats, lengths, tokens, labels)`` of every clip of the sampled speakers."""

    def __init__(self, sampler, tensors):
        self.sampler, self.tensors = sampler, tensors

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        for idx in self.sampler:
            yield tuple(t[idx] for t in self.tensors)


def make_speaker_private(
    model, optimizer, loader, *, speakers, dp, info, epochs, class_weights, batch_adaptive, audit
):
    """Speaker-level DP-SGD (:mod:`speechbrain_fl.privacy.speaker_dpsgd`): Opacus's
    ``GradSampleModule`` for the per-clip gradients, speakers Poisson-sampled at rate ``q``, each
    speaker's mean (``dp["speaker_reduction"]``: or sum) gradient clipped to ``C``, noise
    ``sigma C`` on the sum over speakers, divided by ``q |S|``.

    ``q = 1 / ceil(|D_priv| / batch_size)`` and ``T = epochs / q``, as for clip-level DP-SGD, so
    a step sees ``batch_size`` clips in expectation and an epoch every clip once in expectation;
    sigma for the target epsilon is the same search at that ``(q, T)``.
    """
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    from speechbrain_fl.privacy.accounting import OPACUS_ACCOUNTANTS
    from speechbrain_fl.privacy.speaker_dpsgd import SpeakerDPOptimizer, SpeakerPoissonSampler
    from speechbrain_fl.privacy.weighted_dpsgd import os_seeded_generator

    if batch_adaptive is not None:
        raise ValueError("privacy_unit speaker: batch-adaptive AW-DP counts records, not speakers")
    ModuleValidator.validate(model, strict=True)
    n = len(loader.dataset)
    if len(speakers) != n:
        raise ValueError(f"speakers: {len(speakers)} ids for {n} records of D_priv")
    steps_per_epoch = len(loader)
    q, steps = 1.0 / steps_per_epoch, epochs * steps_per_epoch
    seed = dp.get("seed")
    sampler = SpeakerPoissonSampler(
        speakers,
        sampling_rate=q,
        steps=steps_per_epoch,
        generator=os_seeded_generator(seed, what="speaker Poisson sampling"),
    )
    check_delta(dp["delta"], sampler.num_speakers)
    sigma = dp.get("noise_multiplier")
    if sigma is None:
        sigma = sigma_for(q, dp["target_epsilon"], steps, dp["delta"], dp["accountant"])
    opacus_accountant = dp["accountant"] if dp["accountant"] in OPACUS_ACCOUNTANTS else "rdp"
    gsm = GradSampleModule(model, loss_reduction="mean")
    engine = SpeakerDPOptimizer(
        optimizer,
        params=list(gsm.parameters()),
        sampler=sampler,
        noise_multiplier=float(sigma),
        clip=dp["clip"],
        accountant=opacus_accountant,
        class_weights=class_weights,
        reduction=dp.get("speaker_reduction", "mean"),
        noise_generator=os_seeded_generator(
            None if seed is None else seed + 1, what="speaker-level DP noise"
        ),
    )
    private = _Private(engine=engine, opacus_accountant=opacus_accountant)
    info.update(
        {
            "privacy_unit": "speaker",
            "speaker_reduction": engine.reduction,
            "speakers": sampler.num_speakers,
            "expected_speakers_per_step": engine.expected_speakers,
            "sampling_rate": q,
            "noise_multiplier": float(sigma),
            "clip": dp["clip"],
            "delta": dp["delta"],
            "accountant": dp["accountant"],
            "opacus_accountant": opacus_accountant,
            "sigma_calibrated_with": None if dp.get("noise_multiplier") else dp["accountant"],
            "planned_steps": steps,
            "aw_dp": class_weights is not None,
        }
    )
    if audit is not None:  # each canary is a speaker of one clip at the bound C
        from speechbrain_fl.privacy.dpsgd_audit import GradientCanaries

        private.canaries = GradientCanaries(
            gsm.named_parameters(), int(audit["canaries"]), clip=dp["clip"], sampling_rate=q
        )
        if class_weights is not None:
            private.canary_label = int(torch.argmax(class_weights))
    logger.info(
        "DP-SGD per speaker: %d speakers, q=%.4f, sigma=%.4f, C=%g, %d steps planned",
        sampler.num_speakers, q, sigma, dp["clip"], steps,
    )  # fmt: skip
    batches = _SpeakerBatches(sampler, loader.dataset.tensors)
    return gsm, engine, batches, private

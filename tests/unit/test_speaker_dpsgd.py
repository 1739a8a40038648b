"""Speaker-level DP-SGD (speechbrain_fl.privacy.speaker_dpsgd and the Private-Gender recipe's
``privacy_unit: speaker`` path): per-speaker sensitivity, noise scale, accounting, and that every
clip of a sampled speaker trains."""

from __future__ import annotations

import functools
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus import GradSampleModule

from speechbrain_fl.privacy.accounting import compute_epsilon
from speechbrain_fl.privacy.speaker_dpsgd import (
    SpeakerDPOptimizer,
    SpeakerPoissonSampler,
    speaker_clipped_sum,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "Private-Gender"))


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@settings(max_examples=60, deadline=None)
@given(
    clips=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    extra_clips=st.integers(1, 40),
    clip=st.floats(0.05, 5.0),
    scale=st.floats(0.01, 100.0),
    weighted=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_one_whole_speaker_moves_the_sum_by_at_most_c(
    clips, extra_clips, clip, scale, weighted, reduction, seed
):
    """Adding a speaker with any number of clips changes sum_s w_s clip(u_s, C) by <= C, with
    u_s the mean or the sum of its per-clip gradients."""
    gen = torch.Generator().manual_seed(seed)
    counts = [*clips, extra_clips]  # the last speaker is the one added / removed
    groups = torch.cat([torch.full((n,), s) for s, n in enumerate(counts)])
    rows = groups.numel()
    grads = [torch.randn(rows, 3, 4, generator=gen) * scale, torch.randn(rows, 5, generator=gen)]
    weights = torch.rand(rows, generator=gen).clamp(min=0.01) if weighted else None
    with_s = speaker_clipped_sum(
        grads, groups, clip=clip, clip_weights=weights, reduction=reduction
    )
    keep = rows - extra_clips
    without = speaker_clipped_sum(
        [g[:keep] for g in grads],
        groups[:keep],
        clip=clip,
        clip_weights=None if weights is None else weights[:keep],
        reduction=reduction,
    )
    assert float((_flat(with_s) - _flat(without)).norm()) <= clip * (1 + 1e-5)


def test_speaker_term_is_the_clipped_mean_of_all_its_clips():
    g = torch.tensor([[3.0, 0.0], [1.0, 0.0], [0.0, 0.5], [0.0, 0.1]])
    out = speaker_clipped_sum([g], torch.tensor([0, 0, 1, 1]), clip=1.0)[0]
    # speaker 0: mean (2, 0) clipped to (1, 0); speaker 1: mean (0, 0.3) unclipped
    assert torch.allclose(out, torch.tensor([1.0, 0.3]), atol=1e-5)
    w = torch.tensor([0.5, 0.5, 1.0, 1.0])  # AW-DP weights after the speaker clip
    out = speaker_clipped_sum([g], torch.tensor([0, 0, 1, 1]), clip=1.0, clip_weights=w)[0]
    assert torch.allclose(out, torch.tensor([0.5, 0.3]), atol=1e-5)


def test_sum_reduction_clips_the_summed_gradient_of_each_speaker():
    g = torch.tensor([[0.3, 0.0], [0.4, 0.0], [0.0, 0.5], [0.0, 0.1], [2.0, 0.0]])
    groups = torch.tensor([0, 0, 1, 1, 2])
    out = speaker_clipped_sum([g], groups, clip=1.0, reduction="sum")[0]
    # speaker 0: sum (0.7, 0) kept (its mean 0.35 is half of it); speaker 1: (0, 0.6) kept;
    # speaker 2, one clip: (2, 0) clipped to (1, 0)
    assert torch.allclose(out, torch.tensor([1.7, 0.6]), atol=1e-5)
    mean = speaker_clipped_sum([g], groups, clip=1.0, reduction="mean")[0]
    assert torch.allclose(mean, torch.tensor([1.35, 0.3]), atol=1e-5)
    # a speaker whose clips all point one way reaches the bound C with sum, not with mean
    big = torch.tensor([[0.4, 0.0]] * 4)
    four = torch.zeros(4, dtype=torch.long)
    assert float(speaker_clipped_sum([big], four, clip=1.0, reduction="sum")[0].norm()) == (
        pytest.approx(1.0, abs=1e-5)
    )
    assert float(speaker_clipped_sum([big], four, clip=1.0)[0].norm()) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="reduction"):
        speaker_clipped_sum([g], groups, clip=1.0, reduction="max")


def test_sampler_returns_every_clip_of_each_sampled_speaker():
    speakers = [f"s{i % 7}" for i in range(40)]  # 7 speakers with 5 or 6 clips, interleaved
    sampler = SpeakerPoissonSampler(
        speakers, sampling_rate=0.4, steps=200, generator=torch.Generator().manual_seed(0)
    )
    sizes = []
    for idx in sampler:
        chosen = {speakers[i] for i in idx.tolist()}
        expected = sorted(i for i, s in enumerate(speakers) if s in chosen)
        assert sorted(idx.tolist()) == expected  # all clips of a sampled speaker, no other
        # groups number the sampled speakers 0..k-1, one number per speaker
        assert sampler.groups.numel() == idx.numel()
        for k in sampler.groups.unique().tolist():
            assert len({speakers[i] for i in idx[sampler.groups == k].tolist()}) == 1
        sizes.append(len(chosen))
    assert sum(sizes) / len(sizes) == pytest.approx(0.4 * 7, rel=0.15)


def _optimizer(model, speakers, *, sigma, clip, q=1.0, seed=0, steps=1, reduction="mean"):
    gsm = GradSampleModule(model, loss_reduction="mean")
    sampler = SpeakerPoissonSampler(
        speakers, sampling_rate=q, steps=steps, generator=torch.Generator().manual_seed(seed)
    )
    opt = SpeakerDPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=1.0),
        params=list(gsm.parameters()),
        sampler=sampler,
        noise_multiplier=sigma,
        clip=clip,
        reduction=reduction,
        noise_generator=torch.Generator().manual_seed(seed + 1),
    )
    return gsm, sampler, opt


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_clip_of_a_sampled_speaker_contributes(reduction):
    """Without noise and with a large C, the update is the mean over speakers of the mean (or
    sum) of each speaker's per-clip gradients, each computed alone with autograd."""
    torch.manual_seed(0)
    speakers = ["a", "a", "a", "b", "c", "c"]
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 1, 0])
    model = torch.nn.Linear(4, 2)
    reference = []
    for i in range(6):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        reference.append(_flat([p.grad for p in model.parameters()]).clone())
    gsm, sampler, opt = _optimizer(model, speakers, sigma=0.0, clip=1e6, reduction=reduction)
    idx = sampler.draw()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(gsm(x[idx]), y[idx]).backward()
    got = _flat(opt.noisy_gradient())
    per_speaker = {}
    for i, s in enumerate(speakers):
        per_speaker.setdefault(s, []).append(reference[i])
    reduce = torch.mean if reduction == "mean" else torch.sum
    expected = sum(reduce(torch.stack(v), 0) for v in per_speaker.values()) / 3  # q |S| = 3
    assert torch.allclose(got, expected, atol=1e-5)
    # dropping any one clip of speaker "a" changes the update: every clip trains
    a_mean_without = torch.stack(per_speaker["a"][1:]).mean(0)
    assert not torch.allclose(a_mean_without, torch.stack(per_speaker["a"]).mean(0), atol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_std_is_sigma_c_over_the_expected_speakers(reduction):
    """Zero gradients: the update is pure noise of std sigma C / (q |S|) per coordinate, the
    same for both reductions (their sensitivity is C)."""
    sigma, clip, q, n_speakers = 1.7, 0.6, 0.25, 40
    model = torch.nn.Linear(200, 100)  # 20100 coordinates
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    gsm, sampler, opt = _optimizer(
        model,
        [f"s{i // 2}" for i in range(2 * n_speakers)],
        sigma=sigma,
        clip=clip,
        q=q,
        reduction=reduction,
    )
    idx = sampler.draw()
    opt.zero_grad()
    # a zero loss keeps every per-clip gradient at 0 while Opacus still fills grad_sample
    (gsm(torch.zeros(idx.numel(), 200)).sum() * 0.0).backward()
    noise = _flat(opt.noisy_gradient())
    expected = sigma * clip / (q * n_speakers)
    n = noise.numel()
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(n)
    # the sample std's standard error is about std / sqrt(2 n)
    assert abs(float(noise.std()) - expected) < 5 * expected / math.sqrt(2 * n)


def test_epsilon_is_the_accountants_for_speaker_rate_sigma_and_steps():
    sigma, q, steps, delta = 1.3, 0.2, 25, 1e-5
    speakers = [f"s{i // 3}" for i in range(30)]  # 10 speakers of 3 clips
    gsm, sampler, opt = _optimizer(
        torch.nn.Linear(3, 2), speakers, sigma=sigma, clip=1.0, q=q, steps=steps
    )
    x, y = torch.randn(30, 3), torch.randint(0, 2, (30,))
    for idx in sampler:
        opt.zero_grad()
        out = gsm(x[idx])
        loss = torch.nn.functional.cross_entropy(out, y[idx]) if idx.numel() else out.sum() * 0
        loss.backward()
        opt.step()
    assert opt.accountant.history == [(sigma, q, steps)]
    assert opt.get_epsilon(delta) == pytest.approx(
        compute_epsilon(
            sampling_rate=q, noise_multiplier=sigma, rounds=steps, delta=delta, accountant="rdp"
        ),
        rel=1e-9,
    )


def test_recipe_train_model_speaker_level(caplog):
    """The recipe's path: q = 1 / ceil(N / batch), T = epochs / q, the PLD epsilon of (q, sigma,
    T), every speaker counted, AW-DP weights and canaries composing."""
    from speechbrain_fl.distill.dp_training import train_model
    from speechbrain_fl.models.gender_classifier import GenderClassifier

    caplog.set_level(logging.ERROR)
    n, frames, mels = 48, 20, 8
    gen = torch.Generator().manual_seed(0)
    speakers = [f"spk{i // 4}" for i in range(n)]  # 12 speakers of 4 clips
    labels = torch.tensor([(i // 4) % 3 for i in range(n)])
    torch.manual_seed(0)
    model = GenderClassifier(n_mels=mels, num_classes=3, dsaf=True, crop_frames=10, channels=8,
                             layers=0, emb_dim=8, privileged=False)  # fmt: skip
    dp = {"target_epsilon": 2.0, "noise_multiplier": None, "delta": 1e-3, "clip": 1.0,
          "accountant": "pld", "seed": 3, "speaker_reduction": "sum"}  # fmt: skip
    with pytest.warns(UserWarning, match="fixed seed"):
        _, info = train_model(
            model,
            feats=torch.randn(n, frames, mels, generator=gen),
            lengths=torch.full((n,), frames),
            tokens=None,
            labels=labels,
            epochs=3,
            batch_size=16,
            opt_class=functools.partial(torch.optim.Adam, lr=0.03),
            dp=dp,
            class_weights=torch.tensor([0.2, 0.5, 1.0]),
            desc="speaker-test",
            audit={"canaries": 20, "confidence": 0.95, "plot": None},
            speakers=speakers,
        )
    assert info["privacy_unit"] == "speaker" and info["speakers"] == 12
    assert info["speaker_reduction"] == "sum"
    assert info["sampling_rate"] == pytest.approx(1 / 3) and info["steps"] == 9
    assert info["expected_speakers_per_step"] == pytest.approx(4.0)
    assert info["epsilon"] == pytest.approx(
        compute_epsilon(
            sampling_rate=1 / 3,
            noise_multiplier=info["noise_multiplier"],
            rounds=9,
            delta=1e-3,
            accountant="pld",
        )  # fmt: skip
    )
    assert info["epsilon"] <= 2.0 and info["audit"]["steps"] == 9


def test_batch_adaptive_aw_dp_is_refused_per_speaker():
    from speechbrain_fl.distill.dp_training import train_model

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="batch-adaptive"):
        train_model(
            model, feats=torch.zeros(4, 2), lengths=torch.ones(4), tokens=None,
            labels=torch.zeros(4, dtype=torch.long), epochs=1, batch_size=2,
            opt_class=torch.optim.SGD, dp={"noise_multiplier": 1.0, "delta": 1e-5, "clip": 1.0,
            "accountant": "rdp"}, class_weights=torch.ones(2), desc="x",
            batch_adaptive={"shares": [0.5, 0.5], "floor": 1}, speakers=list("aabb"),
        )  # fmt: skip

"""The teacher's DP-SGD audit (train_model's gradient canaries): below the accountant, above it
with the noise halved.

The recipe's own training path (``speechbrain_fl.distill.dp_training.train_model``: Opacus with the OS-seeded
engine, fixed AW-DP weights, Adam, Poisson batches) on a small multimodal classifier and random
features (q = 0.5, 16 steps, sigma = 2: PLD epsilon 5.05, RDP 5.54 at delta = 1e-5), 1000
gradient canaries from the OS. The noise is mis-scaled in the test only (Opacus's
``_generate_noise`` patched), so the accountant still reports the real sigma's epsilon.
Measured over 20 runs each (min/median/max, sd): one-shot 2.74/3.43/3.92 (sd 0.33) on the real
code, 6.24/6.79/7.53 (sd 0.33) with the noise halved (every run flagged exceeds_accountant);
lower bound 0.77/1.19/1.49 and 1.93/2.26/2.76: both margins about five sd. (8 steps at sigma 1.5 left
too thin a margin under Adam: 5.65-5.71 against 5.22.) About 7 s of CPU.
"""

import functools
import logging
import sys
from pathlib import Path

import pytest
import torch
from opacus.optimizers import optimizer as opacus_optimizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "Private-Gender"))

from speechbrain_fl.distill.dp_training import train_model  # noqa: E402
from speechbrain_fl.models.gender_classifier import GenderClassifier  # noqa: E402

N, FRAMES, MELS, BATCH, EPOCHS, SIGMA, CANARIES = 64, 40, 40, 32, 8, 2.0, 1000


def _train(noise_scale=1.0, monkeypatch=None, plot=None):
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(N, FRAMES, MELS, generator=gen)
    lengths = torch.full((N,), FRAMES)
    labels = torch.randint(0, 3, (N,), generator=gen)
    tokens = torch.randint(0, 16, (N, 4), generator=gen)
    torch.manual_seed(0)
    model = GenderClassifier(n_mels=MELS, num_classes=3, dsaf=True, crop_frames=30, channels=64,
                             layers=1, emb_dim=8, privileged=True, priv_buckets=16, priv_dim=4,
                             modality_dropout=0.5)  # fmt: skip
    if noise_scale != 1.0:  # deliberately mis-scaled noise; the accountant still sees SIGMA
        real = opacus_optimizer._generate_noise

        def scaled(std, reference, generator=None, secure_mode=False):  # real's signature
            return real(std * noise_scale, reference, generator, secure_mode)

        monkeypatch.setattr(opacus_optimizer, "_generate_noise", scaled)
    dp = {"noise_multiplier": SIGMA, "delta": 1e-5, "clip": 1.0, "accountant": "pld"}
    _, info = train_model(
        model,
        feats=feats,
        lengths=lengths,
        tokens=tokens,
        labels=labels,
        epochs=EPOCHS,
        batch_size=BATCH,
        opt_class=functools.partial(torch.optim.Adam, lr=0.03),
        dp=dp,
        class_weights=torch.tensor([0.1, 0.3, 1.0]),
        desc="audit-test",
        audit={"canaries": CANARIES, "confidence": 0.95, "plot": plot},
    )
    return info


def test_teacher_audit_below_accountant_and_catches_halved_noise(caplog, monkeypatch, tmp_path):
    caplog.set_level(logging.ERROR)
    honest = _train(plot=tmp_path / "audit_cosines.png")
    audit, eps = honest["audit"], honest["epsilon"]
    assert honest["accountant"] == "pld" and eps < honest["epsilon_rdp"]
    assert audit["accountant_epsilon"] == eps and audit["steps"] == honest["steps"] == 16
    assert audit["insertions"] > 0 and (tmp_path / "audit_cosines.png").stat().st_size > 0
    assert audit["epsilon_lower_bound"] <= eps  # provable, at 95%
    assert audit["epsilon_one_shot"] < eps and not audit["exceeds_accountant"]
    broken = _train(noise_scale=0.5, monkeypatch=monkeypatch)
    assert broken["epsilon"] == pytest.approx(eps)  # the accountant does not see the bug
    assert broken["audit"]["epsilon_one_shot"] > eps and broken["audit"]["exceeds_accountant"]

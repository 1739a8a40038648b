"""Time per step of DP-SGD (Opacus) vs non-private training, hooks vs ghost clipping.

For the Private-Gender models (``speechbrain_fl/models/gender_classifier.py``): the default
multimodal teacher (pooled log-mel statistics + Linear, hashed-token privileged branch) and a
Conv1d audio model (the student's encoder, which a DP teacher could also use), on random inputs
of the recipe's shapes (batch 256, 400 frames of 40 log-mels, 24 privileged tokens). Each
variant runs the same forward/backward/optimizer step with Adam:

* ``non-private``: plain PyTorch;
* ``hooks``: Opacus ``PrivacyEngine.make_private(grad_sample_mode="hooks")`` (materialised
  per-sample gradients, then flat clipping and noise);
* ``ghost``: ``grad_sample_mode="ghost"`` (ghost clipping: per-sample norms without
  materialising per-sample gradients, a second backward pass for the clipped sum).

Fixed batches (no Poisson sampling) so every variant sees the same batch size; warm-up steps
are excluded; the median of ``--steps`` timed steps is reported with the ratios to the
non-private step. The target of the recipe is a DP step at most 2x the non-private one.

Run: ``OMP_NUM_THREADS=1 python benchmarks/dp_sgd_overhead.py [--steps 20] [--batch 256]
[--device cuda]`` (on CUDA each timed step ends with ``torch.cuda.synchronize``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

from speechbrain_fl.models.gender_classifier import GenderClassifier

MODELS = {
    "teacher (pooled stats, multimodal)": dict(layers=0, emb_dim=8, privileged=True,
                                               priv_buckets=256, priv_dim=8),
    "conv (2 Conv1d, audio-only)": dict(layers=2, channels=32, stride=2, emb_dim=32),
}  # fmt: skip


class _Wrapped(torch.nn.Module):
    """One-tensor-in interface for Opacus's data loader: (feats, lengths, tokens) packed."""

    def __init__(self, model, frames, mels):
        super().__init__()
        self.model, self.frames, self.mels = model, frames, mels

    def forward(self, packed):
        feats = packed[:, : self.frames * self.mels].reshape(-1, self.frames, self.mels)
        rest = packed[:, self.frames * self.mels :].long()
        tokens = rest[:, 1:] if self.model.is_multimodal else None
        return self.model(feats, rest[:, 0], tokens)


def _time(step, steps, warmup=3, sync=lambda: None):
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name, options, *, batch, frames, mels, steps, device="cpu"):
    torch.manual_seed(0)
    feats = torch.randn(batch, frames, mels)
    extra = torch.cat(
        [torch.full((batch, 1), frames), torch.randint(1, 256, (batch, 24))], 1
    ).float()
    data = TensorDataset(
        torch.cat([feats.reshape(batch, -1), extra], 1), torch.randint(0, 3, (batch,))
    )
    out = {}
    for mode in ("non-private", "hooks", "ghost"):
        torch.manual_seed(0)
        model = _Wrapped(GenderClassifier(n_mels=mels, num_classes=3, **options), frames, mels)
        model = model.to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        loader = DataLoader(data, batch_size=batch)
        criterion = torch.nn.CrossEntropyLoss()
        if mode != "non-private":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = PrivacyEngine().make_private(
                    module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
                    noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                    grad_sample_mode=mode,
                )  # fmt: skip
            if mode == "ghost":
                model, optimizer, criterion, loader = made
            else:
                model, optimizer, loader = made
        x, y = next(iter(loader))
        x, y = x.to(device), y.to(device)

        def step(model=model, optimizer=optimizer, criterion=criterion, x=x, y=y, mode=mode):
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y) if mode == "ghost" else F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

        sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
        out[mode] = _time(step, steps, sync=sync)
    base = out["non-private"]
    print(
        f"\n{name}: batch {batch}, {sum(p.numel() for p in model.parameters())} parameters, "
        f"device {device}"
    )
    print(f"  {'mode':<12} {'ms/step':>9} {'x non-private':>14}")
    for mode, seconds in out.items():
        print(f"  {mode:<12} {seconds * 1e3:9.1f} {seconds / base:14.2f}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--mels", type=int, default=40)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    args = parser.parse_args(argv)
    print(f"torch threads: {torch.get_num_threads()}")
    for name, options in MODELS.items():
        bench(
            name,
            options,
            batch=args.batch,
            frames=args.frames,
            mels=args.mels,
            steps=args.steps,
            device=args.device,
        )


if __name__ == "__main__":
    main()

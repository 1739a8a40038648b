"""A SUPERB client's local training is bit-reproducible under the engine's per-round seed.

transformers draws wav2vec 2.0's SpecAugment time masks from numpy's *global* generator, which
the engine does not seed; ``SuperbBrain.on_fit_start`` ties it to the torch seed the engine sets
for each client and round. Two local trainings from the same global model and torch seed must
give bit-identical parameters whatever numpy's global state was before (a Ray actor's numpy
state depends on which clients it ran earlier).
"""

from __future__ import annotations

import csv
import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"
sys.path.insert(0, str(RECIPE))


def _tiny_corpus(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        t = np.arange(16000) / 16000
        wav = 0.3 * np.sin(2 * np.pi * (200 + 100 * i) * t) + 0.05 * rng.standard_normal(16000)
        path = folder / f"u{i}.wav"
        sf.write(path, wav.astype(np.float32), 16000)
        rows.append({"ID": f"u{i}", "duration": 1.0, "wav": str(path), "spk_id": f"s{i % 2}",
                     "label": ["yes", "no"][i % 2]})  # fmt: skip
    manifest = folder / "train.csv"
    with open(manifest, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def _train(brain, dataset, initial, seed):
    brain.modules.load_state_dict(initial)
    torch.manual_seed(seed)  # what the engine's client does before each round's fit
    brain.fit(
        [1], dataset, progressbar=False, train_loader_kwargs={"batch_size": 2, "shuffle": True}
    )
    return {k: v.detach().clone() for k, v in brain.modules.state_dict().items()}


@pytest.mark.slow  # ~17 s of CPU; ~60 s wall under load
def test_local_training_is_bit_reproducible_whatever_numpys_global_state(tmp_path):
    import superb_task
    from speechbrain.utils.Accuracy import AccuracyStats
    from speechbrain.utils.metric_stats import ErrorRateStats

    from speechbrain_fl.models.multi_exit_optim import WarmupCosine
    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit, resolve_backbone

    torch.set_num_threads(1)
    # the objects base.yaml builds: the model factory, the optimiser, the schedule, the metrics
    hparams = {"seed": 0, "lr": 1e-3, "backbone_lr_multiplier": 1.0, "max_grad_norm": 5.0,
               "dataloader_options": {"batch_size": 2}, "eval_dataloader_options": {},
               "model_factory": build_multi_exit,
               "opt_class": functools.partial(torch.optim.AdamW, weight_decay=0.0),
               "lr_annealing": WarmupCosine(), "error_stats": ErrorRateStats,
               "accuracy_stats": AccuracyStats}  # fmt: skip
    settings = {
        "run_opts": {"noprogressbar": True},
        "eval_exits": [6],
        "model": {"source": resolve_backbone("tiny", cache_dir=tmp_path), "num_outputs": 2,
                  "cache_dir": str(tmp_path), "exits": [3, 6, 9, 12], "head": "utterance",
                  "freeze_feature_encoder": False, "seed": 0},
    }  # fmt: skip
    brain = superb_task.build_brain(settings, hparams, depth=6)
    dataset = superb_task.make_dataset(_tiny_corpus(tmp_path), str(tmp_path), labels=["yes", "no"])
    initial = {k: v.detach().clone() for k, v in brain.modules.state_dict().items()}
    assert brain.modules.model.backbone.config.mask_time_prob > 0  # SpecAugment is on

    np.random.seed(1)
    first = _train(brain, dataset, initial, seed=7)
    np.random.seed(12345)  # another numpy history before the same client round
    second = _train(brain, dataset, initial, seed=7)
    other = _train(brain, dataset, initial, seed=8)

    changed = [k for k in first if not torch.equal(first[k], initial[k])]
    assert changed, "training changed no parameter"
    assert all(torch.equal(first[k], second[k]) for k in first)  # bit-identical
    assert any(not torch.equal(first[k], other[k]) for k in first)  # the seed matters

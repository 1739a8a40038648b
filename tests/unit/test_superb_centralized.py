"""The SUPERB centralized scenario: one optimiser and one lr schedule for the whole run.

``run_centralized`` used to call ``brain.fit`` once per epoch, and every ``fit`` built a fresh
AdamW (``init_optimizers``), so Adam's moments and step count were reset each epoch. Now one
``fit`` runs all epochs; the optimiser, the per-step scheduler, the epoch counter and the rows
are checkpointed, so an interrupted run resumes with the optimiser state it had.
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


def _manifest(folder: Path, name: str, count: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        t = np.arange(8000) / 16000
        wav = 0.3 * np.sin(2 * np.pi * (200 + 300 * (i % 2)) * t) + 0.05 * rng.standard_normal(8000)
        path = folder / f"{name}{i}.wav"
        sf.write(path, wav.astype(np.float32), 16000)
        rows.append({"ID": f"{name}{i}", "duration": 0.5, "wav": str(path),
                     "spk_id": f"s{i % 3}", "label": ["yes", "no"][i % 2]})  # fmt: skip
    manifest = folder / f"{name}.csv"
    with open(manifest, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def _setup(tmp_path, epochs):
    from speechbrain.utils.Accuracy import AccuracyStats
    from speechbrain.utils.metric_stats import ErrorRateStats
    from superb_settings import SuperbSettings

    from speechbrain_fl.models.multi_exit_optim import WarmupCosine
    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit, resolve_backbone

    train = _manifest(tmp_path, "train", 8, 0)
    valid = _manifest(tmp_path, "valid", 4, 1)
    settings = SuperbSettings(
        run_opts={"noprogressbar": True},
        data_folder=str(tmp_path),
        clients=[str(train)],
        valid_csv=str(valid),
        test_csv=str(valid),
        labels=["yes", "no"],
        data_kw={"labels": ["yes", "no"]},
        eval_exits=[3],
        model={"source": resolve_backbone("tiny", cache_dir=tmp_path), "num_outputs": 2,
               "cache_dir": str(tmp_path), "exits": [3, 6, 9, 12], "head": "utterance",
               "freeze_feature_encoder": False, "seed": 0,
               "config_overrides": {"layerdrop": 0.0}, "normalize_input": False},
    )  # fmt: skip
    # the objects base.yaml builds (model_factory, opt_class, lr_annealing, the metrics)
    hparams = {
        "save_folder": str(tmp_path / "save"),
        "output_folder": str(tmp_path),
        "centralized_epochs": epochs,
        "seed": 0, "lr": 1e-3, "backbone_lr_multiplier": 0.5, "max_grad_norm": 5.0,
        "balanced_sampling": False,
        "dataloader_options": {"batch_size": 4, "shuffle": True},
        "eval_dataloader_options": {"batch_size": 4},
        "model_factory": build_multi_exit,
        "opt_class": functools.partial(torch.optim.AdamW, weight_decay=0.0),
        "lr_annealing": WarmupCosine(warmup_fraction=0.25, min_ratio=0.1),
        "error_stats": ErrorRateStats,
        "accuracy_stats": AccuracyStats,
    }  # fmt: skip
    Path(hparams["save_folder"]).mkdir(exist_ok=True)
    return settings, hparams


def _spy(monkeypatch):
    """Record every Brain the task builds and every optimiser it makes."""
    import superb_task

    brains, optimizers = [], []
    build = superb_task.build_brain
    init = superb_task.SuperbBrain.init_optimizers

    def build_brain(*args, **kwargs):
        brains.append(build(*args, **kwargs))
        return brains[-1]

    def init_optimizers(self):
        init(self)
        optimizers.append(self.optimizer)

    monkeypatch.setattr(superb_task, "build_brain", build_brain)
    monkeypatch.setattr(superb_task.SuperbBrain, "init_optimizers", init_optimizers)
    return superb_task, brains, optimizers


def _adam_steps(optimizer):
    return {int(state["step"]) for state in optimizer.state.values()}


@pytest.mark.slow  # ~10 s of CPU
def test_one_optimizer_and_schedule_for_all_epochs(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    superb_task, brains, optimizers = _spy(monkeypatch)
    settings, hparams = _setup(tmp_path, epochs=3)
    superb_task.run_centralized(settings, hparams)
    # one optimiser for the run (the old loop built one per epoch: 3)
    assert len(optimizers) == 1
    # 8 clips / batch 4 = 2 steps per epoch, 3 epochs: Adam's step count is never reset
    assert _adam_steps(optimizers[0]) == {6}
    brain = brains[-1]
    assert brain.total_steps == 6 and brain.scheduler.last_epoch == 6
    # heads at lr, backbone at lr * multiplier, both at the schedule's last factor
    from speechbrain_fl.models.multi_exit_optim import lr_factor

    last = lr_factor(6, 6, warmup_fraction=0.25, min_ratio=0.1)
    lrs = {g["name"]: g["lr"] for g in optimizers[0].param_groups}
    assert lrs["heads"] == pytest.approx(1e-3 * lr_factor(7, 6, warmup_fraction=0.25,
                                                          min_ratio=0.1))  # fmt: skip
    assert lrs["backbone"] == pytest.approx(0.5 * lrs["heads"])
    assert last == pytest.approx(lr_factor(7, 6, warmup_fraction=0.25, min_ratio=0.1))
    with open(tmp_path / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2", "3"]
    assert all(r["train_loss"] for r in rows[1:])


@pytest.mark.slow  # ~10 s of CPU
def test_an_interrupted_run_resumes_with_its_optimizer_state(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    superb_task, brains, optimizers = _spy(monkeypatch)
    settings, hparams = _setup(tmp_path, epochs=1)
    superb_task.run_centralized(settings, hparams)
    assert _adam_steps(optimizers[-1]) == {2}
    hparams["centralized_epochs"] = 2  # the same run, asked for one more epoch
    superb_task.run_centralized(settings, hparams)
    # the checkpoint's Adam state (2 steps) continued by one epoch (2 more), not restarted
    assert _adam_steps(optimizers[-1]) == {4}
    with open(tmp_path / "rounds.csv", newline="") as handle:
        assert [r["round"] for r in csv.DictReader(handle)] == ["0", "1", "2"]

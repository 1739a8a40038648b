"""The SUPERB tiny seed model's bag-of-words pretraining: the loss reaches the layers up to the
exits in ``pretrain_exits`` and no further, and each choice of exits has its own cached seed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"))

from librispeech_prepare import prepare_librispeech  # noqa: E402
from superb_data import seed_model_folder  # noqa: E402

from speechbrain_fl.data.superb_synth import generate_librispeech  # noqa: E402


@pytest.fixture(scope="module")
def public_split(tmp_path_factory):
    root = tmp_path_factory.mktemp("public")
    folder = str(root / "librispeech")
    generate_librispeech(folder, splits={"public": 1}, utterances_per_speaker=2, seed=0,
                         speaker_offset=900, progress=False)  # fmt: skip
    prepare_librispeech(folder, str(root / "manifests"), splits=("public",))
    return os.path.join(root, "manifests", "public.csv"), folder


def _hparams(cache, exits):
    return {"model": "tiny", "cache_folder": str(cache), "pretrain_objective": "bag_of_words",
            "pretrain_steps": 2, "pretrain_lr": 0.01, "pretrain_batch_size": 2,
            "pretrain_exits": exits, "pretrain_seed": None, "seed": 0}  # fmt: skip


def _layers(folder):
    from transformers import Wav2Vec2Model

    model = Wav2Vec2Model.from_pretrained(folder)
    return [dict(layer.state_dict()) for layer in model.encoder.layers]


def _changed(before, after):
    return [
        any(not torch.equal(b[name], a[name]) for name in b)
        for b, a in zip(before, after, strict=True)
    ]


def test_pretrain_exits_bound_the_layers_the_loss_trains(public_split, tmp_path):
    from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone

    random = _layers(resolve_backbone("tiny", cache_dir=str(tmp_path), seed=0))
    shallow, timings = seed_model_folder(_hparams(tmp_path, [3]), public_split)
    assert "pretraining" in timings
    # the loss at exit 3 trains Transformer layers 1-3 and leaves 4-12 as drawn
    assert _changed(random, _layers(shallow)) == [True] * 3 + [False] * 9
    deep, _ = seed_model_folder(_hparams(tmp_path, [12]), public_split)
    assert deep != shallow  # each choice of exits is a seed of its own in the cache
    assert all(_changed(random, _layers(deep)))
    again, timings = seed_model_folder(_hparams(tmp_path, [12]), public_split)
    assert again == deep and timings == {}

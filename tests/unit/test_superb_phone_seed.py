"""The phone seed: espeak-ng phoneme timings as frame labels, pretraining, layer probes, the
shipped seed (checked by sha256 and settings) and the recipe's ``pretrain_objective: phones``."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "SUPERB" / "studies"))
sys.path.insert(0, str(ROOT / "recipes" / "SUPERB"))

SHIPPED = ROOT / "recipes" / "SUPERB" / "seed"


def test_frame_labels_follow_the_phonemes():
    from speechbrain_fl.models.multi_exit_phone_seed import FRAME_S, SILENCE, phone_corpus

    [(speaker, wav, labels)] = phone_corpus(1, 1, seed=0, offset=900)
    assert speaker == 0 and len(labels) == int(len(wav) / 16000 / FRAME_S)
    phones = [p for p in labels if p != SILENCE]
    assert len(phones) > len(labels) / 2
    assert not any(mark in "".join(labels) for mark in "',%=")  # stress marks dropped
    runs = [p for i, p in enumerate(phones) if i == 0 or phones[i - 1] != p]
    assert len(runs) >= 8  # the phonemes in order, each over several frames


def test_a_small_run_writes_the_seed_ships_it_and_probes_every_layer(tmp_path):
    from phone_seed import main
    from safetensors.torch import load_file

    from speechbrain_fl.models.multi_exit_phone_seed import seed_tensors
    from speechbrain_fl.recipe.seed_model import file_digest

    out = main(
        ["--out", str(tmp_path / "out"), "--cache_folder", str(tmp_path), "--speakers", "2",
         "--utterances", "2", "--probe_speakers", "2", "--probe_utterances", "3", "--steps", "2",
         "--probe_steps", "3", "--ship", str(tmp_path / "ship")]
    )  # fmt: skip
    assert (tmp_path / "out" / "seed" / "config.json").is_file()
    saved = json.loads((tmp_path / "out" / "phone_seed.json").read_text())
    assert "out" not in saved["settings"] and saved["settings"]["steps"] == 2
    for model in ("random", "phone_seed"):
        for probe in ("content", "speaker"):
            accuracies = saved["probes"][model][probe]
            assert sorted(accuracies, key=int) == [str(layer) for layer in range(1, 13)]
            assert all(0.0 <= a <= 1.0 for a in accuracies.values())
    assert out["phones"][0] == "_"
    manifest = json.loads((tmp_path / "ship" / "seed.json").read_text())
    assert manifest["sha256"] == file_digest(tmp_path / "ship" / "seed.safetensors")
    assert manifest["settings"]["objective"] == "phones" and manifest["settings"]["steps"] == 2
    trained = seed_tensors(tmp_path / "out" / "seed")
    shipped = load_file(tmp_path / "ship" / "seed.safetensors")
    assert sorted(shipped) == sorted(trained)
    assert all(torch.allclose(trained[k], shipped[k].float(), atol=1e-2) for k in trained)


def _hparams(cache, **changes):
    """The phone-seed keys of hparams/kws35.yaml (the default task)."""
    from superb_task import load_hparams

    hparams, _, _ = load_hparams(ROOT / "recipes" / "SUPERB" / "hparams" / "kws35.yaml")
    keys = ("model", "pretrain_objective", "pretrain_steps", "pretrain_lr", "pretrain_batch_size",
            "pretrain_seed", "phone_corpus", "shipped_seed", "seed")  # fmt: skip
    return {**{k: hparams[k] for k in keys}, "cache_folder": str(cache), **changes}


def test_the_default_starts_from_the_shipped_seed_checked_by_sha256(tmp_path, monkeypatch):
    import superb_data
    from safetensors.torch import load_file

    from speechbrain_fl.models.multi_exit_phone_seed import seed_tensors
    from speechbrain_fl.recipe.shipped_seed import ShippedSeedError

    hparams = _hparams(tmp_path)
    assert hparams["pretrain_objective"] == "phones"
    folder, timings = superb_data.seed_model_folder(hparams, None)
    assert timings == {} and "shipped" in Path(folder).name
    loaded, shipped = seed_tensors(folder), load_file(SHIPPED / "seed.safetensors")
    assert sorted(loaded) == sorted(shipped)
    assert all(torch.equal(loaded[k], shipped[k].float()) for k in shipped)
    # a damaged file is refused, naming it and the rebuild command
    damaged = tmp_path / "damaged"
    shutil.copytree(SHIPPED, damaged)
    data = bytearray((damaged / "seed.safetensors").read_bytes())
    data[-1] ^= 1
    (damaged / "seed.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(superb_data, "SHIPPED_SEED", str(damaged))
    with pytest.raises(ShippedSeedError, match="seed.safetensors: sha256 .*studies/phone_seed.py"):
        superb_data.seed_model_folder(_hparams(tmp_path / "other_cache"), None)


def test_other_settings_pretrain_the_phone_seed_here(tmp_path, caplog):
    from superb_data import seed_model_folder

    corpus = {"speakers": 1, "utterances": 2, "speaker_offset": 900}
    hparams = _hparams(tmp_path, pretrain_steps=2, phone_corpus=corpus)
    with caplog.at_level(logging.INFO):
        folder, timings = seed_model_folder(hparams, None)
    assert "pretraining" in timings and (Path(folder) / "config.json").is_file()
    said = [r.getMessage() for r in caplog.records if "pretrained locally" in r.getMessage()]
    assert len(said) == 1 and "steps: 600 -> 2" in said[0]
    stats = json.loads((Path(folder) / "pretraining.json").read_text())
    assert stats["phones"][0] == "_"
    again, timings = seed_model_folder(hparams, None)
    assert again == folder and timings == {}  # cached


def test_the_pretraining_depends_on_its_settings_only(tmp_path):
    import numpy as np

    from speechbrain_fl.models.multi_exit_phone_seed import phone_corpus, phone_set
    from speechbrain_fl.models.multi_exit_phone_seed import pretrain_phone_seed as pretrain

    corpus = phone_corpus(1, 2, seed=0, offset=900)
    kwargs = {"steps": 2, "batch_size": 2, "lr": 2e-3, "seed": 0, "cache_dir": str(tmp_path)}
    first = pretrain(corpus, phone_set(corpus), log=None, **kwargs)[0].backbone.state_dict()
    np.random.seed(99)  # transformers' time masks draw from NumPy's global generator
    state = np.random.get_state()
    second = pretrain(corpus, phone_set(corpus), log=None, **kwargs)[0].backbone.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert np.array_equal(np.random.get_state()[1], state[1])  # the global generator restored

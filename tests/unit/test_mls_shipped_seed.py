"""The shipped seed: sha256 and settings checks (generic kit) and the MLS recipe's use of it."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from speechbrain_fl.recipe.shipped_seed import (
    MANIFEST,
    TENSORS,
    ShippedSeedError,
    shipped_seed_folder,
    shipped_seed_serves,
    write_shipped_seed,
)

ROOT = Path(__file__).resolve().parents[2]
MLS = ROOT / "recipes" / "MLS"


def _serve(folder, cache, settings, calls):
    def materialise(tensors, out):
        calls.append(tensors)
        (out / "marker.json").write_text("{}")

    return shipped_seed_folder(
        folder, settings=settings, cache_folder=cache, prefix="seed",
        materialise=materialise, marker="marker.json", rebuild_hint=", or rebuild it (cmd)",
    )  # fmt: skip


def test_shipped_seed_served_once_in_float32(tmp_path):
    tensors = {"encoder.w": torch.tensor([0.1, -2.0, 3.0])}
    manifest = write_shipped_seed(tmp_path / "seed", tensors, settings={"k": 2, "steps": (1, 2)})
    calls = []
    first = _serve(tmp_path / "seed", tmp_path / "cache", {"k": 2, "steps": [1, 2]}, calls)
    again = _serve(tmp_path / "seed", tmp_path / "cache", {"k": 2, "steps": [1, 2]}, calls)
    assert first == again and Path(first).name == f"seed_{manifest['sha256'][:10]}"
    assert len(calls) == 1 and calls[0]["encoder.w"].dtype == torch.float32
    # the values are the float16 ones: what every machine starts from
    assert torch.equal(calls[0]["encoder.w"], tensors["encoder.w"].half().float())


def test_other_settings_pretrain_locally_with_one_line(tmp_path, caplog):
    write_shipped_seed(tmp_path / "seed", {"w": torch.ones(1)}, settings={"k": 2, "prompt": "a"})
    with caplog.at_level(logging.INFO, logger="speechbrain_fl.recipe.shipped_seed"):
        assert not shipped_seed_serves(tmp_path / "seed", {"k": 4, "prompt": "a"})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "k: 2 -> 4" in lines[0] and "pretrained locally" in lines[0]
    assert _serve(tmp_path / "seed", tmp_path / "cache", {"k": 4, "prompt": "a"}, []) is None
    assert not shipped_seed_serves(tmp_path / "none", {"k": 2})  # no shipped seed at all


def test_sha256_mismatch_is_an_error_naming_the_file(tmp_path):
    write_shipped_seed(tmp_path / "seed", {"w": torch.ones(4)}, settings={"k": 2})
    path = tmp_path / "seed" / TENSORS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShippedSeedError, match=r"seed\.safetensors: sha256 .* does not match"):
        _serve(tmp_path / "seed", tmp_path / "cache", {"k": 2}, [])
    path.unlink()
    with pytest.raises(ShippedSeedError, match="missing"):
        _serve(tmp_path / "seed", tmp_path / "cache", {"k": 2}, [])


@pytest.fixture(scope="module")
def mls():
    sys.path.insert(0, str(MLS))
    import mls_seed_model
    import train_fl

    return train_fl, mls_seed_model


def _hparams(train_fl, tmp_path, *overrides):
    run = train_fl.RECIPE.parse(
        [str(MLS / "hparams" / "alpha_split.yaml"), "--output_folder", str(tmp_path / "out"),
         "--cache_folder", str(tmp_path / "cache"), *overrides]
    )  # fmt: skip
    return run.hparams, run.run_opts


def test_the_default_run_is_served_by_the_shipped_seed(mls, tmp_path):
    """base.yaml's settings are the shipped seed's: the main command pretrains nothing."""
    train_fl, seeds = mls
    hparams, run_opts = _hparams(train_fl, tmp_path)
    manifest = json.loads((seeds.SHIPPED_SEED / MANIFEST).read_text())
    assert manifest["settings"] == json.loads(json.dumps(seeds.seed_settings(hparams, run_opts)))
    assert seeds.shipped_seed_serves(hparams, run_opts)
    for extra in (["--pretrain_ctc_steps", "2"], ["--prompt", "say {language}"],
                  ["--shipped_seed", "False"], ["--languages", "[english, german]"]):  # fmt: skip
        hparams, run_opts = _hparams(train_fl, tmp_path, *extra)
        assert not seeds.shipped_seed_serves(hparams, run_opts), extra


def test_shipped_seed_loads_through_build_speech_llm(mls, tmp_path):
    """Materialised in the cache, the shipped tensors load back unchanged as a checkpoint
    folder of build_speech_llm, with no connector or CTC head (a fresh one is drawn)."""
    train_fl, seeds = mls
    hparams, run_opts = _hparams(train_fl, tmp_path)
    folder = seeds._shipped_folder(hparams, run_opts)
    assert (Path(folder) / "speech_llm.json").is_file()
    assert not (Path(folder) / "extra.safetensors").exists()
    from safetensors.torch import load_file

    shipped = load_file(seeds.SHIPPED_SEED / TENSORS)
    loaded = seeds.seed_tensors(folder)
    assert set(loaded) == set(shipped)
    assert all(torch.equal(loaded[k], shipped[k].float()) for k in shipped)

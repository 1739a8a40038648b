"""Every MLS hparams file runs end to end in ``--debug`` mode on a tiny embedded corpus.

Like SpeechBrain's ``tests/recipes/<Dataset>.csv`` runs: the real script, the real
HyperPyYAML files, Flower's Simulation Engine (Ray) and the real privacy mechanisms, shrunk by
``--debug`` (2 rounds, 2 local epochs of 2 batches) and command-line overrides (2 languages,
2 training speakers each). The corpus and the seed model are generated once into a shared cache.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "MLS" / "train_fl.py"
HPARAMS = sorted(
    p.name for p in (ROOT / "recipes" / "MLS" / "hparams").glob("*.yaml") if p.name != "base.yaml"
)
TINY_CORPUS = [
    "--languages", "[english, german]",
    "--corpus_speakers_per_language", "2",
    "--corpus_utterances_per_speaker", "4",
    "--corpus_public_speakers_per_language", "1",
    "--corpus_public_utterances_per_speaker", "8",
    "--corpus_eval_utterances_per_speaker", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mls_cache")


def run_recipe(hparams, out, cache, *extra, cwd=ROOT):
    cmd = [sys.executable, str(SCRIPT), hparams, "--debug", "--output_folder", str(out),
           "--cache_folder", str(cache), *TINY_CORPUS, *extra]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_hparams_files_found():
    assert HPARAMS == sorted(
        f"{m}.yaml"
        for m in ("fedavg", "flat", "pfl_uniform", "pfl_dim", "pfl_dim_ema", "pfl_unif_ema",
                  "alpha_split")
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("hparams", HPARAMS)
def test_recipe_debug(hparams, tmp_path, cache):
    out = tmp_path / "out"
    proc = run_recipe(f"hparams/{hparams}", out, cache)
    results = json.loads((out / "results.json").read_text())
    method = hparams[: -len(".yaml")]
    assert results["method"] == method
    assert 0.0 <= results["test"]["WER"] and len(results["test"]["WER_ci95"]) == 2
    assert set(results["test"]["per_language"]) == {"english", "german"}
    rounds = (out / "rounds.csv").read_text().splitlines()
    assert rounds[1].startswith("0,") and len(rounds) == 1 + 1 + 2  # header, round 0, 2 rounds
    privacy = results["privacy"]
    if method == "fedavg":
        assert privacy["epsilon"] is None
    else:
        assert privacy["epsilon"] > 0 and math.isfinite(privacy["epsilon"])
        assert set(privacy["sigma_eff"]) >= {"encoder", "llm"}
        # Every per-layer method calibrates noise to C: no pool is noisier-than-sigma-free.
        assert min(privacy["sigma_eff"].values()) >= privacy["noise_multiplier"] * (1 - 1e-9)
    if method == "alpha_split":
        assert privacy["sigma_eff"]["encoder"] == pytest.approx(0.1 / math.sqrt(0.05))
        assert privacy["sigma_eff"]["llm"] == pytest.approx(0.1 / math.sqrt(0.95))
    assert (out / "plots" / "metrics_by_round.png").is_file()
    assert (out / "test_utterances.csv").is_file()
    assert "WER" in proc.stdout


@pytest.mark.slow
def test_recipe_frozen_encoder_from_recipe_dir(tmp_path, cache):
    """Run from recipes/MLS/ with the encoder frozen: no encoder group is trained or clipped."""
    out = tmp_path / "out"
    run_recipe("hparams/flat.yaml", out, cache, "--freeze_encoder", "True",
               cwd=ROOT / "recipes" / "MLS")  # fmt: skip
    groups = (out / "group_norms.csv").read_text().splitlines()
    assert not any(",encoder," in line for line in groups[1:])
    assert json.loads((out / "results.json").read_text())["freeze_encoder"] is True


def run_expecting_failure(tmp_path, *args):
    """Run the recipe with bad arguments; it must fail and create no output folder."""
    out = tmp_path / "o"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "hparams/flat.yaml", *args, "--output_folder", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert not out.exists()
    return proc.stderr


def test_typo_in_override_fails_before_work(tmp_path):
    assert "numbr_of_rounds" in run_expecting_failure(tmp_path, "--numbr_of_rounds", "3")


def test_refused_run_option_fails_before_work(tmp_path):
    stderr = run_expecting_failure(tmp_path, "--ckpt_interval_minutes", "5")
    assert "--ckpt_interval_minutes is not supported by the federated recipe" in stderr


@pytest.mark.slow
def test_run_options_clip_only_run_and_transcribe(tmp_path, cache):
    """SpeechBrain's run options reach the Brains; a clipping method without noise reports no
    epsilon (never Infinity); the final model loads and transcribes with transcribe.py."""
    out = tmp_path / "out"
    proc = run_recipe("hparams/pfl_dim.yaml", out, cache, "--noise_multiplier", "0",
                      "--max_grad_norm", "0.5", "--grad_accumulation_factor", "2",
                      "--eval_precision", "fp32", "--noprogressbar")  # fmt: skip
    log = proc.stdout + proc.stderr + (out / "log.txt").read_text()
    assert (
        "max_grad_norm which is specified in hparams was overridden by command line input to: 0.5"
        in log
    )
    assert "non-private run" in log
    text = (out / "results.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    privacy = json.loads(text)["privacy"]
    assert privacy["epsilon"] is None and privacy["sigma_eff"] == {} and privacy["clip"] == 1.0
    wav = next(Path(cache).glob("mls_synth/mls_english/test/audio/*/*/*.flac"))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("transcribe.py")), str(out / "final_model"),
         str(wav), "--language", "english", "--max_new_tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(str(wav) + "\t")


def test_unknown_preset_fails_before_work(tmp_path):
    stderr = run_expecting_failure(tmp_path, "--model", "whisper_tiny_llama")
    assert "whisper_tiny_llama" in stderr and "whisper_tinyllama" in stderr


@pytest.mark.slow
def test_recipe_norm_profile_and_auto_alpha(tmp_path, cache):
    """--profile_rounds measures component norms without DP and alpha: auto uses them."""
    out = tmp_path / "out"
    proc = run_recipe("hparams/alpha_split.yaml", out, cache, "--profile_rounds", "1",
                      "--alpha", "auto")  # fmt: skip
    profile = json.loads((out / "profile" / "profile.json").read_text())
    assert profile["per_matrix_mean_norm"]["encoder"] > 0
    assert profile["recommendation"]["method"] in ("alpha_split", "pfl_dim_ema")
    assert "outside the DP guarantee" in profile["caveat"]
    results = json.loads((out / "results.json").read_text())
    alpha = results["privacy"]["alpha"]
    assert 0.0 < alpha < 1.0
    assert results["privacy"]["sigma_eff"]["encoder"] == pytest.approx(0.1 / math.sqrt(alpha))
    assert "Privacy caveat" in proc.stdout

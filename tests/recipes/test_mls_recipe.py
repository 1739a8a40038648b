"""MLS-only checks of the MLS recipe runs.

The generic debug run of every MLS hparams file (outputs present, results.json keys, rounds.csv
length) is a row of ``tests/recipes/recipes.csv``, run by ``tests/recipes/test_recipes.py``.
Here: the privacy section of each method's run (the same runs, through the session fixture
``recipe_run``), the frozen encoder, the norm profile with ``alpha: auto``. The arguments
refused before any work are rows of ``tests/recipes/bad_inputs.csv`` (``test_bad_inputs.py``).
Corpus and seed model come from the session's MLS cache folder.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.runner import ROOT, ROWS, run_script

SCRIPT = ROOT / "recipes" / "MLS" / "train_fl.py"
MLS_ROWS = {Path(row.hparams).stem: row for row in ROWS if row.recipe == "MLS"}


def _run(out, recipe_cache, *extra, hparams="flat", cwd=ROOT):
    proc = run_script(MLS_ROWS[hparams], out, recipe_cache("MLS"), *extra, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(MLS_ROWS))
def test_privacy_section(method, recipe_run):
    run = recipe_run(MLS_ROWS[method].id)
    results = json.loads((run.output_folder / "results.json").read_text())
    assert set(results["test"]["per_language"]) == {"english", "german"}
    privacy = results["privacy"]
    if method == "fedavg":
        assert privacy["epsilon"] is None
        return
    assert privacy["epsilon"] > 0 and math.isfinite(privacy["epsilon"])
    # the engine's PLD figure, with Opacus's RDP beside it as a cross-check (RDP is looser)
    assert privacy["accountant"] == "pld" and privacy["epsilon_rdp"] >= privacy["epsilon"]
    assert set(privacy["sigma_eff"]) >= {"encoder", "llm"}
    # Every per-layer method calibrates noise to C: no pool is noisier-than-sigma-free.
    assert min(privacy["sigma_eff"].values()) >= privacy["noise_multiplier"] * (1 - 1e-9)
    assert "add/remove" in privacy["guarantee"]
    assert {"rounds.csv", "group_norms.csv"} <= set(privacy["outside_guarantee"])
    if method == "audit":
        assert "Privacy: epsilon is client-level" in run.stdout
        # the audit run: this run's own mechanism, the canaries' figures beside the accountant's
        assert privacy["caveats"] == [] and privacy["epsilon_covers_everything"] is True
        audit = privacy["audit"]
        assert audit["canaries"] == 128 and audit["accountant_epsilon"] == privacy["epsilon"]
        assert 0 <= audit["epsilon_lower_bound"] <= privacy["epsilon"]
        assert audit["exceeds_accountant"] is False
        assert "Audit (128 canaries" in run.stdout and "one-shot estimate" in run.stdout
        return
    # a training run holds its clients' updates only (no canaries), its epsilon that of the
    # labelled simulated deployment of the method files: M = 1000 of N = 100,000, delta 1e-6
    assert "audit" not in privacy and "Audit (" not in run.stdout
    assert privacy["sampling_rate"] == 0.01 and privacy["delta"] == 1e-6
    assert privacy["simulated_deployment"]["noise_cohort_size"] == 1000
    assert "SIMULATED deployment" in privacy["guarantee"]
    assert "Privacy: epsilon is the client-level (epsilon, delta)-DP of a SIMULATED" in run.stdout
    if method.endswith("_ema"):
        assert privacy["ema_signal"]["signal"] == "noisy"
        with open(run.output_folder / "rounds.csv", newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))  # the EMA left its warm-up: round 2's budgets moved
        budget = [
            {k: r[k] for k in r if k.startswith("budget_")} for r in rows if r["round"] != "0"
        ]
        assert budget[0] and budget[0] != budget[1]
    if method == "alpha_split":
        assert privacy["sigma_eff"]["encoder"] == pytest.approx(1.0 / math.sqrt(0.05))
        assert privacy["sigma_eff"]["llm"] == pytest.approx(1.0 / math.sqrt(0.95))


@pytest.mark.slow
def test_simulated_deployment_is_labelled(tmp_path, recipe_cache):
    """noise_cohort_size / accounting_population: results.json and the printed table say the
    epsilon is the simulated deployment's (q = M / N), not this run's clients'."""
    out = tmp_path / "out"
    proc = _run(out, recipe_cache, "--noise_cohort_size", "1000",
                "--accounting_population", "100000", hparams="alpha_split")  # fmt: skip
    privacy = json.loads((out / "results.json").read_text())["privacy"]
    assert privacy["sampling_rate"] == 0.01 and privacy["epsilon_covers_everything"] is False
    assert privacy["simulated_deployment"]["noise_cohort_size"] == 1000
    assert privacy["simulated_deployment"]["population"] == 100000
    assert "SIMULATED deployment" in privacy["guarantee"] and "audit" not in privacy
    assert "SIMULATED DEPLOYMENT: the epsilon above is that of 1000 clients" in proc.stdout


@pytest.mark.slow
def test_secure_aggregation_keeps_the_accountant(tmp_path, recipe_cache, recipe_run):
    """alpha-split under SecAgg+: the same mechanism and epsilon, the trust model disclosed."""
    plain = json.loads(
        (recipe_run(MLS_ROWS["alpha_split"].id).output_folder / "results.json").read_text()
    )["privacy"]
    out = tmp_path / "out"
    _run(out, recipe_cache, "--secure_aggregation", "secaggplus", "--audit_canaries", "0",
         hparams="alpha_split")  # fmt: skip
    privacy = json.loads((out / "results.json").read_text())["privacy"]
    assert privacy["trust_model"]["name"] == "secure_aggregation"
    assert plain["trust_model"]["name"] == "central"
    assert privacy["epsilon"] == pytest.approx(plain["epsilon"], rel=1e-12)
    assert privacy["sigma_eff"] == pytest.approx(plain["sigma_eff"])
    with open(out / "rounds.csv", newline="", encoding="utf-8") as handle:
        assert len(list(csv.DictReader(handle))) == 3  # round 0 and both rounds released


@pytest.mark.slow
def test_recipe_frozen_encoder_from_recipe_dir(tmp_path, recipe_cache):
    """Run from recipes/MLS/ with the encoder frozen: no encoder group is trained or clipped."""
    out = tmp_path / "out"
    _run(out, recipe_cache, "--freeze_encoder", "True", cwd=ROOT / "recipes" / "MLS")
    groups = (out / "group_norms.csv").read_text().splitlines()
    assert not any(",encoder," in line for line in groups[1:])
    assert json.loads((out / "results.json").read_text())["freeze_encoder"] is True


@pytest.mark.slow
def test_auto_alpha_refusal_names_a_clip_and_kappa_that_fit(tmp_path, recipe_cache):
    """When alpha_kappa x the profiled encoder norm reaches the clip, no alpha < 1 fits: the
    profile is still written, and the run stops with the clip and alpha_kappa that would."""
    out = tmp_path / "out"
    proc = run_script(MLS_ROWS["alpha_split"], out, recipe_cache("MLS"), "--profile_rounds", "1",
                      "--alpha", "auto", "--alpha_kappa", "1000000")  # fmt: skip
    assert proc.returncode != 0
    profile = json.loads((out / "profile" / "profile.json").read_text())
    assert profile["alpha"] is None and profile["per_matrix_mean_norm"]["encoder"] > 0
    assert "gives alpha = 0.25" in profile["alpha_refused"]
    log = proc.stdout + proc.stderr
    assert "alpha: auto:" in log and "--alpha_kappa" in log
    assert not (out / "results.json").exists()


@pytest.mark.slow
def test_run_options_clip_only_run_and_transcribe(tmp_path, recipe_cache):
    """SpeechBrain's run options reach the Brains; a clipping method without noise reports no
    epsilon (never Infinity); the final model loads and transcribes with transcribe.py."""
    out = tmp_path / "out"
    proc = _run(out, recipe_cache, "--noise_multiplier", "0", "--noise_cohort_size", "null",
                "--accounting_population", "null", "--max_grad_norm", "0.5",
                "--grad_accumulation_factor", "2", "--eval_precision", "fp32", "--noprogressbar",
                hparams="pfl_dim")  # fmt: skip
    log = proc.stdout + proc.stderr + (out / "log.txt").read_text()
    assert (
        "max_grad_norm which is specified in hparams was overridden by command line input to: 0.5"
        in log
    )
    assert "non-private run" in log
    text = (out / "results.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    privacy = json.loads(text)["privacy"]
    assert privacy["epsilon"] is None and privacy["sigma_eff"] == {} and privacy["clip"] == 0.25
    assert "audit" not in privacy  # no noise: the canaries are ignored (nothing to audit)
    wav = next(Path(recipe_cache("MLS")).glob("mls_synth/mls_english/test/audio/*/*/*.flac"))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("transcribe.py")), str(out / "final_model"),
         str(wav), "--language", "english", "--max_new_tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(str(wav) + "\t")
    # without --language: a usage error naming the option and the languages trained on
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("transcribe.py")), str(out / "final_model"),
         str(wav)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "give --language (it was trained on: english, german)" in proc.stderr


@pytest.mark.slow
def test_recipe_norm_profile_and_auto_alpha(tmp_path, recipe_cache):
    """--profile_rounds measures component norms without DP and alpha: auto uses them.

    alpha = (alpha_kappa * encoder norm / C)^2: with the LLM's adapters frozen (the tiny
    default) the encoder is most of the update (a debug round's encoder norm ~2 at lr 0.01), so
    kappa 2 and C = 1 would ask alpha >= 1 (refused, next test); kappa 0.5 and C = 3 keep the
    selection inside (0, 1) up to an encoder norm of 6."""
    out = tmp_path / "out"
    proc = _run(out, recipe_cache, "--profile_rounds", "1", "--alpha", "auto", "--clip", "3.0",
                "--alpha_kappa", "0.5", hparams="alpha_split")  # fmt: skip
    profile = json.loads((out / "profile" / "profile.json").read_text())
    assert profile["per_matrix_mean_norm"]["encoder"] > 0
    assert profile["recommendation"]["method"] in ("alpha_split", "pfl_dim_ema")
    assert "outside the DP guarantee" in profile["caveat"]
    results = json.loads((out / "results.json").read_text())
    alpha = results["privacy"]["alpha"]
    assert 0.0 < alpha < 1.0
    assert results["privacy"]["sigma_eff"]["encoder"] == pytest.approx(1.0 / math.sqrt(alpha))
    assert "Privacy caveat" in proc.stdout
    # the reported epsilon is labelled as not covering the profiling rounds and the alpha
    privacy = results["privacy"]
    assert privacy["epsilon_covers_everything"] is False
    assert "profile.json" in privacy["outside_guarantee"]
    assert any("profiling" in c for c in privacy["caveats"])
    assert any("alpha: auto" in c for c in privacy["caveats"])
    assert "NOT covered by epsilon" in proc.stdout


@pytest.mark.slow
def test_debug_run_on_a_real_layout_tree_with_some_languages(tmp_path):
    """A user's MLS folder: only two of the eight languages downloaded and no public split. The
    run uses the languages present (naming the missing ones) and carves the tiny seed model's
    public split from training speakers (``public_speaker_share``)."""
    import shutil

    from speechbrain_fl.data.mls_synth import generate_mls_corpus

    synth = tmp_path / "synth"
    generate_mls_corpus(
        str(synth), languages=["english", "german"], speakers_per_language=3,
        utterances_per_speaker=4, public_speakers_per_language=1,
        public_utterances_per_speaker=2, eval_utterances_per_speaker=2, progress=False,
    )  # fmt: skip
    real = tmp_path / "mls"
    for lang in ("english", "german"):  # the real release: train, dev, test and metainfo only
        src, dst = synth / f"mls_{lang}", real / f"mls_{lang}"
        for split in ("train", "dev", "test"):
            shutil.copytree(src / split, dst / split)
        for extra in src.iterdir():
            if extra.is_file():
                shutil.copy(extra, dst / extra.name)
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "hparams/fedavg.yaml", "--debug", "--data_folder",
           str(real), "--output_folder", str(out), "--cache_folder", str(tmp_path / "cache"),
           "--public_speaker_share", "0.34", "--sampling_rate", "1.0"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((out / "results.json").read_text())["data"]
    assert sorted(data["languages"]) == ["english", "german"]
    assert "french" in data["missing_languages"] and len(data["missing_languages"]) == 6
    public = (out / "save" / "manifests" / "public.csv").read_text().splitlines()
    train = (out / "save" / "manifests" / "train.csv").read_text().splitlines()
    speakers = {line.split(",")[3] for line in public[1:]}
    assert speakers and not speakers & {line.split(",")[3] for line in train[1:]}


@pytest.mark.slow
def test_prepare_only_fills_the_cache_and_trains_nothing(tmp_path, recipe_cache):
    """prepare_only: manifests, partition and seed model ready; no round, no results.json."""
    out = tmp_path / "out"
    proc = _run(out, recipe_cache, "--prepare_only", "True")
    assert "prepare_only: corpus, manifests and seed model ready" in proc.stdout + proc.stderr
    assert (out / "save" / "manifests" / "test.csv").is_file()
    assert (out / "save" / "partition" / "partition.json").is_file()
    assert list(Path(recipe_cache("MLS")).glob("seed_tiny_*/speech_llm.json"))
    assert not (out / "results.json").exists() and not (out / "rounds.csv").exists()


def test_centralized_scenario_trains_the_pooled_data_for_the_federated_budget(
    tmp_path, recipe_cache
):
    """--scenario centralized: no rounds, the federated run's expected steps on the pooled
    client utterances, and the test WER and per-utterance CE against round 0."""
    out = tmp_path / "out"
    proc = _run(out, recipe_cache, "--scenario", "centralized", hparams="fedavg")
    results = json.loads((out / "results.json").read_text())
    central = results["centralized"]
    assert results["scenario"] == "centralized" and central["steps"] == central["federated_budget"]
    assert central["stages"] == 2 and central["pooled_utterances"] > 0
    assert set(results["test_ce"]) == {"final", "round0"}
    for name in ("test_utterances", "test_ce_utterances"):
        assert (out / f"{name}.csv").is_file() and (out / f"{name}_round0.csv").is_file()
    assert not (out / "rounds.csv").exists()
    assert "Centralized ceiling: test WER" in proc.stdout

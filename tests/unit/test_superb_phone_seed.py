"""The phone seed study: espeak-ng phoneme timings as frame labels, pretraining, layer probes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STUDIES = Path(__file__).resolve().parents[2] / "recipes" / "SUPERB" / "studies"
sys.path.insert(0, str(STUDIES))


def test_frame_labels_follow_the_phonemes_and_leave_the_audio_unchanged():
    from phone_seed import FRAME_S, SILENCE, synthesize_phones

    from speechbrain_fl.data.espeak import Voice, synthesize

    voice = Voice(language="en", variant="m2")
    wav, labels = synthesize_phones("stop the red car", voice, seed=3)
    assert (wav == synthesize("stop the red car", voice, seed=3)).all()
    assert len(labels) == int(len(wav) / 16000 / FRAME_S)
    phones = [p for p in labels if p != SILENCE]
    assert len(phones) > len(labels) / 2
    assert labels[0] == "s" and "'" not in "".join(labels)  # stress marks dropped
    runs = [p for i, p in enumerate(phones) if i == 0 or phones[i - 1] != p]
    assert len(runs) >= 8  # s t 0 p D @ r E d k A: ...: the phonemes in order, each over frames


def test_a_small_run_writes_the_seed_and_probes_every_layer(tmp_path):
    from phone_seed import main

    out = main(
        ["--out", str(tmp_path / "out"), "--cache_folder", str(tmp_path), "--speakers", "2",
         "--utterances", "2", "--probe_speakers", "2", "--probe_utterances", "3", "--steps", "2",
         "--probe_steps", "3"]
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

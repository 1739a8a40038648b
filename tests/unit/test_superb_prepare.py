"""SUPERB prepare scripts on generated trees in the real layouts, and their layout errors."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "SUPERB"))

from iemocap_prepare import prepare_iemocap  # noqa: E402
from librispeech_prepare import prepare_librispeech  # noqa: E402
from speech_commands_prepare import prepare_speech_commands  # noqa: E402
from voxceleb_prepare import prepare_voxceleb1  # noqa: E402

from speechbrain_fl.data.superb_synth import (  # noqa: E402
    generate_librispeech,
    generate_speech_commands,
)
from speechbrain_fl.data.superb_synth_speakers import generate_iemocap, generate_voxceleb1  # noqa: E402


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def sc_v1(tmp_path_factory):
    root = tmp_path_factory.mktemp("sc1") / "speech_commands_v0.01"
    generate_speech_commands(
        str(root), train_speakers=3, valid_speakers=1, test_speakers=1, repeats=1,
        unknown_words_per_speaker=2, noise_seconds=2, progress=False,
    )  # fmt: skip
    return root


def test_speech_commands_layout(sc_v1):
    assert (sc_v1 / "validation_list.txt").is_file() and (sc_v1 / "testing_list.txt").is_file()
    assert sorted(os.listdir(sc_v1 / "_background_noise_"))
    name = next(iter(os.listdir(sc_v1 / "yes")))
    assert name.endswith("_nohash_0.wav") and len(name.split("_")[0]) == 8


def test_kws12_manifests(sc_v1, tmp_path):
    report = prepare_speech_commands(str(sc_v1), str(tmp_path), task="kws12")
    assert report["labels"][-2:] == ["_silence_", "_unknown_"] and len(report["labels"]) == 12
    train, test = _rows(tmp_path / "train.csv"), _rows(tmp_path / "test.csv")
    valid = _rows(tmp_path / "valid.csv")
    # 10 commands + 2 unknown words per speaker, + 10% silence
    assert len([r for r in train if r["label"] != "_silence_"]) == 3 * 12
    assert {r["label"] for r in train} == set(report["labels"])
    # split by speaker, as the real lists are
    spk = {s: {r["spk_id"] for r in rows if r["label"] != "_silence_"} for s, rows in
           (("train", train), ("valid", valid), ("test", test))}  # fmt: skip
    assert not spk["train"] & spk["test"] and not spk["train"] & spk["valid"]
    silence = [r for r in train if r["label"] == "_silence_"]
    assert silence and all(int(r["stop"]) - int(r["start"]) == 16000 for r in silence)
    assert {r["spk_id"] for r in silence} <= spk["train"]  # spread over training speakers
    assert all(r["wav"].startswith("$data_root/") for r in train)
    # unchanged options: skipped; changed option: prepared again
    assert prepare_speech_commands(str(sc_v1), str(tmp_path), task="kws12")["skipped"]
    again = prepare_speech_commands(str(sc_v1), str(tmp_path), silence_fraction=0.5)
    assert not again["skipped"]


def test_kws35_manifests(tmp_path):
    root = tmp_path / "sc2"
    generate_speech_commands(
        str(root), version=2, train_speakers=1, valid_speakers=1, test_speakers=1, repeats=1,
        noise_seconds=2, progress=False,
    )  # fmt: skip
    report = prepare_speech_commands(str(root), str(tmp_path / "save"), task="kws35")
    assert len(report["labels"]) == 35 and "visual" in report["labels"]
    assert report["counts"] == {"train": 35, "valid": 35, "test": 35}


def test_speech_commands_wrong_layout(tmp_path, sc_v1):
    (tmp_path / "yes").mkdir()
    with pytest.raises(OSError, match=r"validation_list.txt.*speech_commands_v0.01.tar.gz"):
        prepare_speech_commands(str(tmp_path), str(tmp_path / "save"))
    with pytest.raises(OSError, match="backward"):  # a v0.01 tree is not KWS-35
        prepare_speech_commands(str(sc_v1), str(tmp_path / "save35"), task="kws35")
    with pytest.raises(OSError, match="does not exist"):
        prepare_speech_commands(str(tmp_path / "nope"), str(tmp_path / "save"))


def test_librispeech(tmp_path):
    root = tmp_path / "ls"
    generate_librispeech(
        str(root), splits={"train-clean-100": 2, "dev-clean": 1, "test-clean": 1},
        utterances_per_speaker=2, progress=False,
    )  # fmt: skip
    report = prepare_librispeech(str(root), str(tmp_path / "save"))
    assert report["counts"] == {"train-clean-100": 4, "dev-clean": 2, "test-clean": 2}
    row = _rows(tmp_path / "save" / "dev-clean.csv")[0]
    assert row["wrd"] == row["wrd"].lower() and row["ID"].startswith(row["spk_id"] + "-")
    with pytest.raises(OSError, match=r"LibriSpeech/train-clean-100.*openslr.org/12"):
        prepare_librispeech(str(tmp_path), str(tmp_path / "save2"))


def test_voxceleb1_sid_and_asv(tmp_path):
    root = tmp_path / "vox"
    generate_voxceleb1(
        str(root), iden_speakers=3, veri_speakers=2, videos_per_speaker=2,
        utterances_per_video=3, trials_per_speaker=2, progress=False,
    )  # fmt: skip
    sid = prepare_voxceleb1(str(root), str(tmp_path / "sid"))
    assert len(sid["labels"]) == 5 and sid["verification_speakers_in_sid_training"]
    asv = prepare_voxceleb1(str(root), str(tmp_path / "asv"), exclude_verification_speakers=True)
    assert asv["labels"] == ["id10001", "id10002", "id10003"]
    assert asv["verification_speakers_in_sid_training"] == []
    trials = _rows(tmp_path / "asv" / "trials.csv")
    assert len(trials) == 8 and {t["target"] for t in trials} == {"0", "1"}
    with pytest.raises(OSError, match=r"iden_split.txt.*vox1.html"):
        prepare_voxceleb1(str(tmp_path / "sid"), str(tmp_path / "x"))


def test_iemocap_fold_and_merge(tmp_path):
    root = tmp_path / "iemocap"
    generate_iemocap(str(root), sessions=3, utterances_per_emotion=2, progress=False)
    report = prepare_iemocap(str(root), str(tmp_path / "save"), test_session=2)
    test = _rows(tmp_path / "save" / "test.csv")
    train = _rows(tmp_path / "save" / "train.csv")
    assert {r["spk_id"] for r in test} == {"Ses02F", "Ses02M"}
    assert not {r["spk_id"] for r in train} & {"Ses02F", "Ses02M"}
    assert {r["label"] for r in test} == {"neu", "hap", "sad", "ang"}  # exc merged into hap
    assert report["dropped"] == {"fru": 3 * 2 * 2}  # 3 sessions x 2 speakers x 2
    with pytest.raises(OSError, match=r"Session4/dialog/EmoEvaluation.*iemocap"):
        prepare_iemocap(str(root), str(tmp_path / "save4"), test_session=4)


def test_embedded_corpora_of_other_seeds_live_side_by_side(tmp_path):
    """Two seeds' embedded corpora get folders of their own in one cache_folder: generating
    the second leaves the first's files in place (a run reading it is not disturbed)."""
    from superb_data import TASKS, _generate

    options = {"train_speakers": 1, "valid_speakers": 1, "test_speakers": 1, "repeats": 1,
               "unknown_words_per_speaker": 1, "noise_seconds": 1}  # fmt: skip
    hparams = {"cache_folder": str(tmp_path), "corpus_options": options, "seed": 1}
    first = Path(_generate(hparams, TASKS["kws12"]))
    files = sorted(p.relative_to(first) for p in first.rglob("*.wav"))
    second = Path(_generate({**hparams, "seed": 2}, TASKS["kws12"]))
    assert first != second and first.parent == second.parent == tmp_path
    assert sorted(p.relative_to(first) for p in first.rglob("*.wav")) == files
    assert _generate(hparams, TASKS["kws12"]) == str(first)  # the same key: the same folder
    bigger = _generate({**hparams, "corpus_options": {**options, "repeats": 2}}, TASKS["kws12"])
    assert bigger not in (str(first), str(second))

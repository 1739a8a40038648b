"""The embedded Common Voice-layout corpus and its preparation (Private-Gender recipe)."""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import pytest
import soundfile as sf

from speechbrain_fl.data.common_voice_synth import (
    COLUMNS,
    LEGACY_COLUMNS,
    generate_common_voice_corpus,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "Private-Gender"))

from common_voice_prepare import prepare_common_voice, read_tsv  # noqa: E402

TINY = {"train": 10, "dev": 5, "test": 5, "validated_only": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("cv") / "cv"
    generate_common_voice_corpus(out, speakers=TINY, clips_per_speaker=2, unlabeled_share=0.2,
                                 progress=False, seed=3)  # fmt: skip
    return out


@pytest.fixture
def copy(corpus, tmp_path):
    dst = tmp_path / "cv"
    shutil.copytree(corpus, dst)
    return dst


def _rewrite(path: Path, edit):
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        fields, rows = reader.fieldnames, list(reader)
    rows = edit(rows)
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, delimiter="\t", quoting=csv.QUOTE_NONE,
                                lineterminator="\n")  # fmt: skip
        writer.writeheader()
        writer.writerows(rows)


def test_layout_columns_and_audio(corpus):
    for split in ("train", "dev", "test", "validated"):
        rows = read_tsv(corpus / f"{split}.tsv")
        assert list(rows[0])[:-1] == list(COLUMNS)  # + "line"
        assert all(r["age"] and r["accents"] and r["sentence"] for r in rows)
    validated = {r["path"] for r in read_tsv(corpus / "validated.tsv")}
    splits = [{r["path"] for r in read_tsv(corpus / f"{s}.tsv")} for s in ("train", "dev", "test")]
    assert set().union(*splits) < validated  # validated-only clips exist
    assert not (splits[0] & splits[1]) and not (splits[0] & splits[2])
    speakers = [{r["client_id"] for r in read_tsv(corpus / f"{s}.tsv")} for s in ("train", "test")]
    assert not speakers[0] & speakers[1]
    clip = corpus / "clips" / read_tsv(corpus / "train.tsv")[0]["path"]
    assert clip.suffix == ".mp3" and sf.info(str(clip)).samplerate == 16000
    values = {r["gender"] for r in read_tsv(corpus / "validated.tsv")}
    assert values <= {"male_masculine", "female_feminine", "non-binary", "transgender",
                      "intersex", "", "do_not_wish_to_say"}  # fmt: skip


def test_generation_is_cached_and_deterministic(corpus, tmp_path):
    again = generate_common_voice_corpus(corpus, speakers=TINY, clips_per_speaker=2,
                                         unlabeled_share=0.2, progress=False, seed=3)  # fmt: skip
    assert again["cached"]
    other = generate_common_voice_corpus(tmp_path / "b", speakers=TINY, clips_per_speaker=2,
                                         unlabeled_share=0.2, progress=False, seed=3)  # fmt: skip
    assert (tmp_path / "b" / "train.tsv").read_text() == (corpus / "train.tsv").read_text()
    assert other["summary"] == again["summary"]


def test_legacy_wav_release(tmp_path):
    out = tmp_path / "legacy"
    generate_common_voice_corpus(out, speakers={"train": 6, "dev": 3, "test": 3}, clips_per_speaker=1,
                                 release_style="legacy", audio_format="wav", unlabeled_share=0.0,
                                 progress=False)  # fmt: skip
    rows = read_tsv(out / "train.tsv")
    assert list(rows[0])[:-1] == list(LEGACY_COLUMNS)
    assert {r["gender"] for r in rows} == {"male", "female", "other"}
    report = prepare_common_voice(out, tmp_path / "m")
    assert report["counts"]["priv"] == {"male": 3, "female": 2, "other": 1}
    manifest = (tmp_path / "m" / "priv.csv").read_text()
    assert ".wav" in manifest and "$data_root/clips/" in manifest


def test_prepare_maps_and_counts_unlabeled(corpus, tmp_path):
    report = prepare_common_voice(corpus, tmp_path / "m")
    train = read_tsv(corpus / "train.tsv")
    unlabeled = sum(r["gender"] in ("", "do_not_wish_to_say") for r in train)
    assert sum(report["counts"]["priv"].values()) + unlabeled == len(train)
    assert report["excluded"]["priv"].get("unlabeled", 0) == unlabeled
    with open(tmp_path / "m" / "priv.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    mapping = {"male_masculine": "male", "female_feminine": "female", "non-binary": "other",
               "transgender": "other", "intersex": "other"}  # fmt: skip
    assert all(mapping[r["gender_raw"]] == r["label"] for r in rows)
    assert all(float(r["duration"]) > 0.3 for r in rows)
    # Unchanged options: skipped; a changed option re-prepares.
    assert prepare_common_voice(corpus, tmp_path / "m")["skipped"]
    binary = prepare_common_voice(corpus, tmp_path / "m", classes=("male", "female"))
    assert not binary["skipped"] and set(binary["counts"]["priv"]) == {"male", "female"}
    assert binary["excluded"]["priv"]["other_class"] > 0


def test_validated_rest_and_aux_subsample(corpus, tmp_path):
    report = prepare_common_voice(corpus, tmp_path / "m", aux_split="validated_rest",
                                  disjoint_by="speaker")  # fmt: skip
    assert sum(report["counts"]["aux"].values()) > 0
    report = prepare_common_voice(corpus, tmp_path / "m2", max_aux=3)
    assert sum(report["counts"]["aux"].values()) == 3


def test_unknown_gender_value_named_nothing_written(copy, tmp_path):
    def edit(rows):
        rows[1]["gender"] = "robot"
        return rows

    _rewrite(copy / "train.tsv", edit)
    with pytest.raises(ValueError, match=r"train\.tsv, line 3: unknown gender value 'robot'"):
        prepare_common_voice(copy, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_overlap_refused_naming_files(copy, tmp_path):
    shared = read_tsv(copy / "train.tsv")[0]

    def edit(rows):
        return rows + [{k: v for k, v in shared.items() if k != "line"}]

    _rewrite(copy / "dev.tsv", edit)
    with pytest.raises(ValueError, match=rf"D_priv and D_aux share 1 recording.*{shared['path']}"):
        prepare_common_voice(copy, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_speaker_overlap_refused_only_when_asked(copy, tmp_path):
    speaker = read_tsv(copy / "train.tsv")[0]["client_id"]

    def edit(rows):
        rows[0]["client_id"] = speaker
        return rows

    _rewrite(copy / "test.tsv", edit)
    prepare_common_voice(copy, tmp_path / "m")  # recording-level: fine
    with pytest.raises(ValueError, match=rf"share 1 speaker.*{speaker}"):
        prepare_common_voice(copy, tmp_path / "m2", disjoint_by="speaker")


def test_missing_class_and_empty_aux(copy, tmp_path):
    _rewrite(copy / "train.tsv", lambda rows: [r for r in rows if r["gender"] == "male_masculine"])
    with pytest.raises(ValueError, match=r"\['female', 'other'\] have no clip in D_priv"):
        prepare_common_voice(copy, tmp_path / "m")
    _rewrite(copy / "dev.tsv", lambda rows: [])
    with pytest.raises(ValueError, match=r"D_aux \(dev\.tsv\) has no labelled clip"):
        prepare_common_voice(copy, tmp_path / "m", priv_split="validated_rest")
    assert not (tmp_path / "m").exists()


def test_corrupt_clip_left_out_and_named(copy, tmp_path):
    clip = copy / "clips" / read_tsv(copy / "test.tsv")[0]["path"]
    clip.write_bytes(b"not audio at all")
    report = prepare_common_voice(copy, tmp_path / "m")
    assert list(report["unreadable_audio"]) == [str(clip)]
    assert report["excluded"]["test"]["unreadable_audio"] == 1
    assert "unreadable_note" in report
    assert clip.name not in (tmp_path / "m" / "test.csv").read_text()


def test_not_a_common_voice_folder(tmp_path):
    with pytest.raises(OSError, match="no clips/"):
        prepare_common_voice(tmp_path, tmp_path / "m")


def test_sigterm_during_synthesis_leaves_no_temporary_folder(tmp_path):
    """A kill (SIGTERM) while clips are written removes the ``.cv_synth.*.tmp`` folder."""
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "cv_synth"
    code = (
        "from speechbrain_fl.data.common_voice_synth import generate_common_voice_corpus\n"
        f"generate_common_voice_corpus({str(out)!r}, speakers={{'train': 400}}, "
        "clips_per_speaker=4, audio_format='wav', progress=False)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            clips = [p for t in tmp_path.glob(".cv_synth.*.tmp") for p in t.glob("clips/*.wav")]
            if len(clips) >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "generation ended before it could be interrupted"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(tmp_path.glob(".cv_synth.*.tmp")) and not out.exists()


def test_voices_cycle_per_split_so_dev_and_test_share_every_voice(tmp_path):
    """With a global speaker index, D_aux's few "other" speakers missed most test voices."""
    from speechbrain_fl.data.common_voice_synth import _pool, voice_coverage

    n_other = len(_pool("other"))
    # shares chosen so that dev and test hold at least a pool of "other" speakers each
    shares = (0.1, 0.1, 0.8)
    speakers = {"train": 4, "dev": 3 * n_other, "test": 2 * n_other}
    from speechbrain_fl.data.common_voice_synth import _speakers

    options = {"seed": 5, "release_style": "2024", "class_shares": list(shares),
               "speakers": speakers, "unlabeled_share": 0.0}  # fmt: skip
    spk = _speakers(options)
    voices: dict = {}
    for s in spk:
        per = voices.setdefault(s.split, {}).setdefault(s.voice.gender, {})
        per[s.voice.variant] = per.get(s.voice.variant, 0) + 1
    cover = voice_coverage({"voices": voices})
    assert cover["other"]["voices"] == n_other and cover["other"]["missing"] == []
    assert cover["other"]["min_speakers_by"] >= 2  # 2.4 * n_other "other" dev speakers
    for label in ("male", "female"):
        test_voices = set(voices["test"][label])
        assert test_voices <= set(voices["dev"][label]), label


def test_generated_stamp_records_voices_and_one_clip_per_speaker(tmp_path):
    out = tmp_path / "cv"
    info = generate_common_voice_corpus(out, speakers={"train": 3, "dev": 3, "test": 3},
                                        audio_format="wav", progress=False)  # fmt: skip
    assert info["options"]["clips_per_speaker"] == 1  # the default: per-clip DP = per-speaker
    rows = read_tsv(out / "train.tsv")
    assert len({r["client_id"] for r in rows}) == len(rows) == 3
    assert sum(sum(v.values()) for v in info["voices"]["dev"].values()) == 3


def test_metadata_ceiling_matches_enumeration_and_is_sharp():
    """The Bayes balanced accuracy of metadata alone, against a brute-force enumeration of all
    decision rules on a small table, and the default tables' value (0.54 before the redesign)."""
    import itertools

    from speechbrain_fl.data.common_voice_synth import metadata_ceiling

    ages = {"a": (0.7, 0.3), "b": (0.2, 0.8), "c": (0.5, 0.5)}
    accents = {"a": (0.6, 0.4), "b": (0.5, 0.5), "c": (0.1, 0.9)}
    cells = list(itertools.product(range(2), range(2)))
    best = 0.0
    for rule in itertools.product("abc", repeat=len(cells)):  # every map cell -> class
        recall = {c: sum(ages[c][i] * accents[c][j] for (i, j), r in zip(cells, rule, strict=True) if r == c)
                  for c in "abc"}  # fmt: skip
        best = max(best, sum(recall.values()) / 3)
    assert metadata_ceiling(ages, accents) == pytest.approx(best)
    assert 0.85 <= metadata_ceiling() <= 0.9

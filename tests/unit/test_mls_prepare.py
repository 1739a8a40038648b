"""recipes/MLS/mls_prepare.py on a generated MLS tree, including malformed trees."""

import csv
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from speechbrain.dataio.dataset import DynamicItemDataset

from speechbrain_fl.data.mls_synth import generate_mls_corpus

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "MLS", "mls_prepare.py")
_spec = importlib.util.spec_from_file_location("mls_prepare", _PATH)
mls_prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mls_prepare)
prepare_mls = mls_prepare.prepare_mls

TINY = dict(
    languages=["english", "german"], speakers_per_language=2, utterances_per_speaker=3, seed=2,
    public_speakers_per_language=1, public_utterances_per_speaker=2, dev_speakers=1,
    test_speakers=1, test_overlap_speakers=1, eval_utterances_per_speaker=2,
    public_test_speakers=1, progress=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("corpus") / "mls")
    generate_mls_corpus(out, **TINY)
    return out


@pytest.fixture
def corpus(pristine, tmp_path):
    copy = str(tmp_path / "mls")
    shutil.copytree(pristine, copy)
    return copy


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_manifests_tables_and_overlap(pristine, tmp_path):
    save = str(tmp_path / "prep")
    report = prepare_mls(pristine, save, splits=("train", "dev", "test", "public"))
    train = _rows(report["csv"]["train"])
    assert list(train[0]) == ["ID", "duration", "wav", "spk_id", "language", "wrd"]
    assert {r["language"] for r in train} == {"english", "german"}
    assert all(r["wav"].startswith("$data_root/mls_") for r in train)
    assert sum(report["counts"]["public"].values()) == 4
    data = DynamicItemDataset.from_csv(report["csv"]["dev"], replacements={"data_root": pristine})
    assert all(os.path.isfile(data.data[k]["wav"]) for k in data.data_ids)
    stats = _rows(os.path.join(save, "train_statistics.csv"))
    assert stats[-1]["language"] == "total" and stats[-1]["clients"] == "4"
    assert "| **Total** |" in open(report["statistics"], encoding="utf-8").read()
    overlap = json.load(open(report["overlap"], encoding="utf-8"))
    assert overlap["total"]["num_overlapping"] == 2
    assert overlap["per_language"]["english"]["fraction_of_clients"] == 0.5
    assert report["num_skipped"] == {
        "unreadable_audio": 0, "transcript_without_audio": 0, "audio_without_transcript": 0
    }  # fmt: skip


def test_skip_and_reprepare_on_changed_option(pristine, tmp_path):
    save = str(tmp_path / "prep")
    prepare_mls(pristine, save)
    mtime = os.path.getmtime(os.path.join(save, "train.csv"))
    prepare_mls(pristine, save)
    assert os.path.getmtime(os.path.join(save, "train.csv")) == mtime
    report = prepare_mls(pristine, save, max_utts_per_split=2)
    assert report["counts"]["train"] == {"english": 2, "german": 2}
    assert prepare_mls(pristine, save, skip_prep=True) == {}


def test_reprepare_when_the_corpus_is_regenerated(corpus, tmp_path):
    save = str(tmp_path / "prep")
    before = {r["ID"] for r in _rows(prepare_mls(corpus, save)["csv"]["train"])}
    # Same folder, other corpus options: the old manifests name files that no longer exist.
    generate_mls_corpus(corpus, **{**TINY, "speakers_per_language": 3})
    after = _rows(prepare_mls(corpus, save)["csv"]["train"])
    assert {r["ID"] for r in after} != before
    assert {r["spk_id"] for r in after} and len({r["spk_id"] for r in after}) == 6
    data = DynamicItemDataset.from_csv(
        os.path.join(save, "train.csv"), replacements={"data_root": corpus}
    )
    assert all(os.path.isfile(data.data[k]["wav"]) for k in data.data_ids)


def test_missing_audio_extra_audio_and_corrupt_flac(corpus, tmp_path):
    train = os.path.join(corpus, "mls_english", "train")
    ids = sorted(line.split("\t")[0] for line in open(os.path.join(train, "transcripts.txt")))

    def audio(u):
        spk, book, _ = u.split("_")
        return os.path.join(train, "audio", spk, book, f"{u}.flac")

    os.remove(audio(ids[0]))
    with open(audio(ids[1]), "wb") as handle:
        handle.write(b"not a flac file")
    shutil.copy(audio(ids[2]), audio(ids[2]).replace("_000", "_999"))
    report = prepare_mls(corpus, str(tmp_path / "prep"), durations="audio")
    skipped = json.load(open(tmp_path / "prep" / "skipped.json", encoding="utf-8"))
    assert skipped["transcript_without_audio"] == [f"mls_english/train/{ids[0]}"]
    assert skipped["unreadable_audio"][0].endswith(f"{ids[1]}.flac")
    assert skipped["audio_without_transcript"][0].endswith(ids[2].replace("_000", "_999") + ".flac")
    assert report["num_skipped"]["unreadable_audio"] == 1
    train_ids = {r["ID"] for r in _rows(report["csv"]["train"])}
    assert ids[0] not in train_ids and ids[1] not in train_ids and ids[2] in train_ids


def test_missing_transcripts_raises(corpus, tmp_path):
    os.remove(os.path.join(corpus, "mls_german", "test", "transcripts.txt"))
    with pytest.raises(OSError, match=r"mls_german/test/transcripts.txt.*openslr.org/94"):
        prepare_mls(corpus, str(tmp_path / "prep"))


def test_malformed_transcript_line(corpus, tmp_path):
    with open(os.path.join(corpus, "mls_english", "dev", "transcripts.txt"), "a") as handle:
        handle.write("no tab here\n")
    with pytest.raises(ValueError, match=r"transcripts.txt:\d+: expected"):
        prepare_mls(corpus, str(tmp_path / "prep"))


def test_not_mls_folder(tmp_path):
    (tmp_path / "librispeech").mkdir()
    with pytest.raises(OSError, match="not an MLS folder.*openslr.org/94"):
        prepare_mls(str(tmp_path), str(tmp_path / "prep"))
    with pytest.raises(OSError, match="does not exist"):
        prepare_mls(str(tmp_path / "nope"), str(tmp_path / "prep"))
    with pytest.raises(OSError, match=r"not an MLS folder: none of \['mls_polish'\]"):
        prepare_mls(str(tmp_path), str(tmp_path / "prep"), languages=["polish"])
    with pytest.raises(ValueError, match="klingon"):
        prepare_mls(str(tmp_path), str(tmp_path / "prep"), languages=["klingon"])


def test_only_some_languages_downloaded(pristine, tmp_path, caplog):
    # The recipe asks for all 8 languages; the user unpacked English and German only.
    wanted = ["english", "german", "dutch", "french", "spanish", "italian", "portuguese", "polish"]
    with caplog.at_level("WARNING", logger=mls_prepare.logger.name):
        report = prepare_mls(pristine, str(tmp_path / "prep"), languages=wanted)
    assert report["languages"] == ["english", "german"]
    assert report["missing_languages"] == wanted[2:]
    assert {r["language"] for r in _rows(report["csv"]["train"])} == {"english", "german"}
    assert "present in" in caplog.text and "english, german" in caplog.text
    assert "missing (left out): dutch, french" in caplog.text


def _drop_public(corpus):
    for language in ("english", "german"):
        for split in ("public", "public_test"):
            shutil.rmtree(os.path.join(corpus, f"mls_{language}", split))


def test_public_split_carved_from_training_speakers(corpus, tmp_path):
    _drop_public(corpus)  # a real MLS tree: train, dev, test only
    splits = ("train", "dev", "test", "public")
    with pytest.raises(OSError, match="no public split.*public_speaker_share"):
        prepare_mls(corpus, str(tmp_path / "refused"), splits=splits)
    before = _rows(prepare_mls(corpus, str(tmp_path / "all"))["csv"]["train"])
    report = prepare_mls(corpus, str(tmp_path / "prep"), splits=splits, public_speaker_share=0.5)
    train, public = _rows(report["csv"]["train"]), _rows(report["csv"]["public"])
    test_spk = {r["spk_id"] for r in _rows(report["csv"]["test"])}
    test_spk |= {r["spk_id"] for r in _rows(report["csv"]["dev"])}
    public_spk, train_spk = {r["spk_id"] for r in public}, {r["spk_id"] for r in train}
    # Each language has 2 training speakers, one of them also in test: the other one moves.
    assert len(public_spk) == 2 and not public_spk & train_spk and not public_spk & test_spk
    assert sorted(r["ID"] for r in train + public) == sorted(r["ID"] for r in before)
    assert report["public_from_train"] == {
        lang: sorted({r["spk_id"] for r in public if r["language"] == lang})
        for lang in ("english", "german")
    }
    stats = _rows(os.path.join(str(tmp_path / "prep"), "train_statistics.csv"))
    assert stats[-1]["clients"] == "2"  # the public speakers are not clients
    again = prepare_mls(corpus, str(tmp_path / "again"), splits=splits, public_speaker_share=0.5)
    assert _rows(again["csv"]["public"]) == public  # deterministic
    with pytest.raises(ValueError, match="public_speaker_share"):
        prepare_mls(corpus, str(tmp_path / "bad"), splits=splits, public_speaker_share=1.5)


def test_carve_public_split_choice():
    rows = [{"spk_id": str(s), "ID": f"{s}_1_{u}"} for s in range(20) for u in range(3)]
    train, public, chosen = mls_prepare.carve_public_split(rows, share=0.25, seed=1, exclude={"3"})
    assert len(chosen) == 5 and "3" not in chosen and len(public) == 15 and len(train) == 45
    shuffled = list(reversed(rows))
    assert mls_prepare.carve_public_split(shuffled, share=0.25, seed=1, exclude={"3"})[2] == chosen
    assert mls_prepare.carve_public_split(rows, share=0.25, seed=2)[2] != chosen
    one = [{"spk_id": "7", "ID": "7_1_0"}]
    assert mls_prepare.carve_public_split(one, share=0.5, seed=0)[2] == []  # a client remains


def test_durations_from_segments_headers_checked(corpus, tmp_path):
    """Durations come from segments.txt (no decoding); every header is still read, so a file
    that is not audio is left out and listed, with the reason, in segments mode too."""
    by_audio = prepare_mls(corpus, str(tmp_path / "audio"), durations="audio")
    broken = sorted(Path(corpus, "mls_english", "train", "audio").rglob("*.flac"))[0]
    broken.write_text("not audio")
    by_segments = prepare_mls(corpus, str(tmp_path / "segments"))
    relative = os.path.relpath(broken, corpus)
    assert by_segments["skipped"]["unreadable_audio"] == [relative]
    assert "Format not recognised" in by_segments["skipped"]["unreadable_audio_reasons"][relative]
    assert "privacy" in by_segments["skipped"]
    for split in ("train", "dev", "test"):
        a = {r["ID"]: float(r["duration"]) for r in _rows(by_audio["csv"][split])}
        s = {r["ID"]: float(r["duration"]) for r in _rows(by_segments["csv"][split])}
        assert a.keys() - s.keys() == ({broken.stem} if split == "train" else set())
        # the generated segments.txt rounds to 10 ms
        assert all(abs(a[k] - s[k]) <= 0.006 for k in s)


def test_malformed_segments_line_names_file_and_line(corpus, tmp_path):
    path = os.path.join(corpus, "mls_english", "train", "segments.txt")
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("1_2_3\tsrc\tnot-a-number\t1.0\n")
    with pytest.raises(ValueError, match=r"segments\.txt:\d+: expected"):
        prepare_mls(corpus, str(tmp_path / "prep"))
    with pytest.raises(ValueError, match="durations: 'x'"):
        prepare_mls(corpus, str(tmp_path / "prep2"), durations="x")

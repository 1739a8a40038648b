"""recipes/MLS/mls_prepare.py on a generated MLS tree, including malformed trees."""

import csv
import importlib.util
import json
import os
import shutil

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
    test_speakers=1, test_overlap_speakers=1, eval_utterances_per_speaker=2, progress=False,
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
    report = prepare_mls(corpus, str(tmp_path / "prep"))
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
    with pytest.raises(OSError, match="no mls_polish/"):
        prepare_mls(str(tmp_path), str(tmp_path / "prep"), languages=["polish"])
    with pytest.raises(ValueError, match="klingon"):
        prepare_mls(str(tmp_path), str(tmp_path / "prep"), languages=["klingon"])

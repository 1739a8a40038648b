"""Embedded MLS-layout corpus: layout, determinism, cache, atomicity."""

import os

import numpy as np
import pytest
import soundfile as sf

from speechbrain_fl.data.mls_synth import METAINFO_HEADER, STAMP_FILE, generate_mls_corpus
from speechbrain_fl.data.sentences import LANGUAGES, make_sentences, vocabulary

TINY = dict(
    languages=["english", "polish"],
    speakers_per_language=2,
    utterances_per_speaker=3,
    seed=5,
    public_speakers_per_language=1,
    public_utterances_per_speaker=2,
    dev_speakers=1,
    test_speakers=1,
    test_overlap_speakers=1,
    eval_utterances_per_speaker=2,
    progress=False,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth") / "mls")
    return out, generate_mls_corpus(out, **TINY)


def _transcripts(path):
    with open(path, encoding="utf-8") as handle:
        return dict(line.rstrip("\n").split("\t") for line in handle)


def test_layout_matches_mls(corpus):
    out, info = corpus
    assert not info["cached"]
    for language in ("english", "polish"):
        base = os.path.join(out, f"mls_{language}")
        with open(os.path.join(base, "metainfo.txt"), encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        assert lines[0] == METAINFO_HEADER
        assert [c.strip() for c in lines[0].split("|")] == [
            "SPEAKER", "GENDER", "PARTITION", "MINUTES", "BOOK ID", "TITLE", "CHAPTER"
        ]  # fmt: skip
        for split in ("train", "dev", "test", "public"):
            trans = _transcripts(os.path.join(base, split, "transcripts.txt"))
            assert trans
            for utt_id, text in trans.items():
                spk, book, idx = utt_id.split("_")
                assert len(idx) == 6
                path = os.path.join(base, split, "audio", spk, book, f"{utt_id}.flac")
                wav, sr = sf.read(path)
                assert sr == 16000 and 0.5 < len(wav) / sr < 5.0
                assert text == text.lower() and set(text.split()) <= vocabulary(language)
            with open(os.path.join(base, split, "segments.txt"), encoding="utf-8") as handle:
                seg_ids = [line.split("\t")[0] for line in handle]
            assert sorted(seg_ids) == sorted(trans)


def test_speaker_roles(corpus):
    out, info = corpus
    base = os.path.join(out, "mls_english")
    spk = {
        s: {u.split("_")[0] for u in _transcripts(os.path.join(base, s, "transcripts.txt"))}
        for s in ("train", "dev", "test", "public")
    }
    assert len(spk["train"]) == 2 and len(spk["train"] & spk["test"]) == 1
    assert not spk["public"] & (spk["train"] | spk["dev"] | spk["test"])
    assert not spk["dev"] & (spk["train"] | spk["test"])
    assert info["summary"]["english"]["public"]["speakers"] == 1


def test_cached_then_regenerated_on_option_change(corpus, tmp_path):
    out, info = corpus
    again = generate_mls_corpus(out, **TINY)
    assert again["cached"] and again["summary"] == info["summary"]
    other = str(tmp_path / "mls")
    generate_mls_corpus(other, **TINY)
    changed = generate_mls_corpus(other, **{**TINY, "utterances_per_speaker": 2})
    assert not changed["cached"]
    assert sorted(os.listdir(tmp_path)) == ["mls"]  # no temporary folder left
    assert os.path.isfile(os.path.join(other, STAMP_FILE))


def test_deterministic_for_seed(corpus, tmp_path):
    out, _ = corpus
    other = str(tmp_path / "copy")
    generate_mls_corpus(other, **TINY)
    for root, _, files in os.walk(out):
        for name in files:
            if name == STAMP_FILE:
                continue
            a = os.path.join(root, name)
            b = os.path.join(other, os.path.relpath(a, out))
            if name.endswith(".flac"):
                np.testing.assert_array_equal(sf.read(a)[0], sf.read(b)[0])
            else:
                assert open(a, "rb").read() == open(b, "rb").read(), name


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    import speechbrain_fl.data.mls_synth as mod

    calls = {"n": 0}
    real = mod.synthesize

    def failing(text, voice):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(text, voice)

    monkeypatch.setattr(mod, "synthesize", failing)
    with pytest.raises(KeyboardInterrupt):
        generate_mls_corpus(str(tmp_path / "mls"), **TINY)
    assert os.listdir(tmp_path) == []


def test_bad_options():
    with pytest.raises(ValueError, match="klingon"):
        generate_mls_corpus("/tmp/unused", languages=["klingon"])
    with pytest.raises(ValueError, match="speakers_per_language"):
        generate_mls_corpus("/tmp/unused", speakers_per_language=0)


def test_sentences_all_languages():
    for language in LANGUAGES:
        words = vocabulary(language)
        assert 60 <= len(words) <= 130, (language, len(words))
        sents = make_sentences(language, 50, seed=1)
        assert sents == make_sentences(language, 50, seed=1)
        assert sents != make_sentences(language, 50, seed=2)
        for s in sents:
            assert set(s.split()) <= words
            assert not any(ch in s for ch in ",.!?-")

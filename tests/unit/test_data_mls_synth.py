"""Embedded MLS-layout corpus: layout, determinism, cache, atomicity."""

import os

import numpy as np
import pytest
import soundfile as sf

from speechbrain_fl.data.mls_synth import (
    CLIENT_ONLY_VARIANTS,
    METAINFO_HEADER,
    PUBLIC_RATE,
    PUBLIC_VARIANTS,
    STAMP_FILE,
    _plan,
    generate_mls_corpus,
)
from speechbrain_fl.data.sentences import (
    LANGUAGES,
    make_sentences,
    novel_words,
    vocabulary,
)

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
    public_test_speakers=1,
    progress=False,
    num_workers=1,
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
        for split in ("train", "dev", "test", "public", "public_test"):
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
        for s in ("train", "dev", "test", "public", "public_test")
    }
    assert len(spk["train"]) == 2 and len(spk["train"] & spk["test"]) == 1
    assert not spk["public"] & (spk["train"] | spk["dev"] | spk["test"] | spk["public_test"])
    assert not spk["public_test"] & (spk["train"] | spk["dev"] | spk["test"])
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


def test_deterministic_for_seed_and_worker_count(corpus, tmp_path):
    out, _ = corpus  # generated in-process (num_workers=1)
    other = str(tmp_path / "copy")
    generate_mls_corpus(other, **{**TINY, "num_workers": 2})  # two spawned processes
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
    with pytest.raises(ValueError, match="num_workers"):
        generate_mls_corpus("/tmp/unused", num_workers=0)


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


def _options(**changes):
    """The options generate_mls_corpus would record, for planning without synthesis."""
    options = {
        "version": 3, "languages": ["english", "german"], "speakers_per_language": 12,
        "utterances_per_speaker": 8, "seed": 3, "public_speakers_per_language": 10,
        "public_utterances_per_speaker": 6, "dev_speakers": 2, "test_speakers": 2,
        "test_overlap_speakers": 1, "eval_utterances_per_speaker": 4,
        "speaker_size_spread": 0.5, "public_test_speakers": 2, "client_novel_share": 0.3,
        "client_rate": [140, 230], "sample_rate": 16000,
    }  # fmt: skip
    return {**options, **changes}


def test_domain_gap_public_text_and_voices_exclude_client_only_ones():
    tasks = _plan(_options())
    public = [t for t in tasks if t.split in ("public", "public_test")]
    client = [t for t in tasks if t.split in ("train", "dev", "test")]
    for language in ("english", "german"):
        novel = novel_words(language)
        assert len(novel) >= 20
        assert not any(set(t.text.split()) & novel for t in public if t.language == language)
        with_novel = [bool(set(t.text.split()) & novel) for t in client if t.language == language]
        # novel_share 0.3 per slot, 3-5 slots per sentence: most sentences have a novel word.
        assert 0.4 < np.mean(with_novel) < 0.95
    assert {t.voice.variant for t in public} <= set(PUBLIC_VARIANTS)
    assert not {t.voice.variant for t in public} & set(CLIENT_ONLY_VARIANTS)
    assert {t.voice.variant for t in client} & set(CLIENT_ONLY_VARIANTS)
    assert all(PUBLIC_RATE[0] <= t.voice.rate <= PUBLIC_RATE[1] for t in public)
    assert all(140 <= t.voice.rate <= 230 for t in client)
    assert max(t.voice.rate for t in client) > PUBLIC_RATE[1]


def test_public_splits_independent_of_federated_and_client_options():
    def public(options):
        return [t for t in _plan(options) if t.split in ("public", "public_test")]

    base = public(_options())
    assert base and base == public(
        _options(
            speakers_per_language=30, dev_speakers=3, utterances_per_speaker=20,
            client_novel_share=0.8, client_rate=[100, 300], test_overlap_speakers=2,
        )
    )  # fmt: skip
    assert base != public(_options(seed=4))
    # No novel phrase at share 0: the client domain then differs by its voices only.
    client = [t for t in _plan(_options(client_novel_share=0.0)) if t.split == "train"]
    assert not any(set(t.text.split()) & novel_words(t.language) for t in client)


def test_speaker_ids_and_books_unique_and_in_scheme():
    tasks = _plan(_options())
    roles = {}
    for t in tasks:
        roles.setdefault((t.speaker, t.book), t.split)
        li = ["english", "german"].index(t.language)
        assert 10000 * (li + 1) <= t.speaker < 10000 * (li + 2)
        assert 100000 + 1000 * li <= t.book < 100000 + 1000 * (li + 1)
    assert len({t.utt_id for t in tasks}) == len(tasks)
    books = {}
    for speaker, book in roles:
        assert books.setdefault(book, speaker) == speaker  # one speaker per book

"""The embedded MLS-layout corpus: espeak-ng speech in the real Multilingual LibriSpeech layout.

``generate_mls_corpus`` writes, for each language, exactly what the MLS archives from
openslr.org/94 unpack to, so ``recipes/MLS/mls_prepare.py`` runs unchanged on it::

    <out_dir>/mls_<language>/metainfo.txt
    <out_dir>/mls_<language>/<split>/transcripts.txt     <spk>_<book>_<utt>\\t<transcript>
    <out_dir>/mls_<language>/<split>/segments.txt        <id>\\t<source>\\t<start>\\t<end>
    <out_dir>/mls_<language>/<split>/audio/<spk>/<book>/<spk>_<book>_<utt>.flac

with ``<split>`` in ``train``, ``dev``, ``test`` and two additions that real MLS does not have:
``public``, a split with its own speakers (disjoint from all others) used to pretrain the
embedded seed model centrally, and ``public_test``, held-out speakers of the same domain (the
seed model's in-domain test). ``metainfo.txt`` lists them with PARTITION ``public`` and
``public_test``.

Domain gap (our choice, not the paper's): a real seed model is pretrained on other text and
other voices than the federated clients hold, and federated training adapts it to theirs. The
public splits read only the public text domain of ``speechbrain_fl/data/sentences.py`` (every
third phrase of each grammar slot held out), with the voice variants of
:data:`PUBLIC_VARIANTS` at :data:`PUBLIC_RATE` words per minute; train, dev and test read the
client domain (each slot a held-out phrase with probability ``client_novel_share``, 0 by
default), with every variant (also :data:`CLIENT_ONLY_VARIANTS`) at rates in ``client_rate``.

As in real MLS (alpha-split paper, Appendix B), a few training speakers also read a different
book in the test split, so the train-client/test-speaker overlap report has something to find.
Training speakers hold different amounts of speech (each speaker's utterance count is scaled
by a factor drawn in [1 - spread, 1 + spread]) so client sizes are unequal, as in Table VI.

Generation is deterministic for a seed, atomic (written to a temporary sibling folder, then
renamed), and cached: a stamp file records the options, and a call with other options
regenerates the corpus. ``segments.txt`` names the espeak-ng voice as the source instead of an
archive.org URL, with start 0 and end the utterance duration.

Example
-------
>>> import tempfile, os
>>> out = os.path.join(tempfile.mkdtemp(), "mls")
>>> info = generate_mls_corpus(out, languages=["english"], speakers_per_language=2,
...     utterances_per_speaker=2, dev_speakers=1, test_speakers=1, eval_utterances_per_speaker=1,
...     public_speakers_per_language=1, public_utterances_per_speaker=1,
...     public_test_speakers=1, progress=False)
>>> sorted(os.listdir(os.path.join(out, "mls_english")))
['dev', 'metainfo.txt', 'public', 'public_test', 'test', 'train']
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
from tqdm.auto import tqdm

from speechbrain_fl.data.corpus_cache import cached_stamp
from speechbrain_fl.data.espeak import SAMPLE_RATE, synthesize
from speechbrain_fl.data.sentences import LANGUAGE_CODES, LANGUAGES, make_sentences
from speechbrain_fl.data.voices import (
    FEMALE_VARIANTS,
    MALE_VARIANTS,
    SpeakerVoice,
    make_speakers,
)
from speechbrain_fl.utils.atomic import atomic_folder

__all__ = [
    "generate_mls_corpus",
    "STAMP_FILE",
    "METAINFO_HEADER",
    "SPLITS",
    "PUBLIC_SPLITS",
    "CLIENT_ONLY_VARIANTS",
    "PUBLIC_VARIANTS",
    "PUBLIC_RATE",
]

logger = logging.getLogger(__name__)

STAMP_FILE = ".mls_synth.json"
_VERSION = 3
SPLITS = ("train", "dev", "test", "public", "public_test")
#: Splits of the public (seed-model) domain; the others are the federated (client) domain.
PUBLIC_SPLITS = ("public", "public_test")
#: Voice variants only client-domain speakers have (every third of each pool in voices.py).
CLIENT_ONLY_VARIANTS = FEMALE_VARIANTS[2::3] + MALE_VARIANTS[2::3]
#: Voice variants of the public domain.
PUBLIC_VARIANTS = tuple(v for v in FEMALE_VARIANTS + MALE_VARIANTS if v not in CLIENT_ONLY_VARIANTS)
#: Speaking rates (words per minute) of the public domain.
PUBLIC_RATE = (140, 200)
_COLUMNS = ("SPEAKER", "GENDER", "PARTITION", "MINUTES", "BOOK ID", "TITLE", "CHAPTER")
_WIDTHS = (10, 10, 10, 10, 10, 30, 30)
METAINFO_HEADER = " | ".join(c.center(w) for c, w in zip(_COLUMNS, _WIDTHS, strict=True))


@dataclass(frozen=True)
class _Task:
    language: str
    split: str
    speaker: int
    book: int
    index: int
    voice: SpeakerVoice
    text: str

    @property
    def utt_id(self) -> str:
        return f"{self.speaker}_{self.book}_{self.index:06d}"


def _plan(options: dict) -> list[_Task]:
    """Every utterance of the corpus, in a fixed order (all randomness drawn here).

    Public-domain speakers (``public``, ``public_test``) and their sentences are drawn first and
    from their own random streams, so the public split, and the seed model pretrained on it,
    stay the same when the federated split sizes or the client-domain options change.
    """
    seed = options["seed"]
    tasks = []
    for li, language in enumerate(options["languages"]):
        rng = np.random.default_rng([seed, 31, li])
        n_train = options["speakers_per_language"]
        n_dev, n_test = options["dev_speakers"], options["test_speakers"]
        n_pub = options["public_speakers_per_language"]
        n_pubtest = options["public_test_speakers"]
        n_public = n_pub + n_pubtest
        voices = make_speakers(
            n_public, seed=seed * 1009 + li, variants=PUBLIC_VARIANTS, rate=PUBLIC_RATE
        ) + make_speakers(
            n_train + n_dev + n_test,
            seed=seed * 1009 + li + 500_009,
            rate=tuple(options["client_rate"]),
        )
        spk_ids = [10000 * (li + 1) + 10 * k + int(rng.integers(10)) for k in range(len(voices))]
        roles = (
            [("public", k) for k in range(n_pub)]
            + [("public_test", n_pub + k) for k in range(n_pubtest)]
            + [("train", n_public + k) for k in range(n_train)]
            + [("dev", n_public + n_train + k) for k in range(n_dev)]
            + [("test", n_public + n_train + n_dev + k) for k in range(n_test)]
        )
        overlap = min(options["test_overlap_speakers"], n_train)
        roles += [
            ("test", n_public + int(k)) for k in sorted(rng.choice(n_train, overlap, replace=False))
        ]
        spread = options["speaker_size_spread"]
        per_split = {
            "train": options["utterances_per_speaker"],
            "dev": options["eval_utterances_per_speaker"],
            "test": options["eval_utterances_per_speaker"],
            "public": options["public_utterances_per_speaker"],
            "public_test": options["eval_utterances_per_speaker"],
        }
        counts = []
        for split, _ in roles:
            n = per_split[split]
            if split == "train" and spread > 0:
                n = int(round(n * rng.uniform(1 - spread, 1 + spread)))
            counts.append(max(1, n) if per_split[split] > 0 else 0)
        is_public = [split in PUBLIC_SPLITS for split, _ in roles]
        texts = {
            True: make_sentences(
                language,
                sum(n for n, p in zip(counts, is_public, strict=True) if p),
                seed=seed * 7 + li,
                domain="public",
            ),
            False: make_sentences(
                language,
                sum(n for n, p in zip(counts, is_public, strict=True) if not p),
                seed=seed * 7 + li + 100_003,
                domain="client",
                novel_share=options["client_novel_share"],
            ),
        }
        cursor = {True: 0, False: 0}
        for r, ((split, k), n, public) in enumerate(zip(roles, counts, is_public, strict=True)):
            book = 100000 + 1000 * li + r
            for i in range(n):
                text = texts[public][cursor[public] + i]
                tasks.append(_Task(language, split, spk_ids[k], book, i, voices[k], text))
            cursor[public] += n
    return tasks


def _write_language(root: str, language: str, tasks: list[_Task], durations: dict) -> None:
    base = os.path.join(root, f"mls_{language}")
    meta = {}
    for split in SPLITS:
        rows = [t for t in tasks if t.split == split]
        if not rows:
            continue
        os.makedirs(os.path.join(base, split), exist_ok=True)
        with open(os.path.join(base, split, "transcripts.txt"), "w", encoding="utf-8") as tr:
            for t in rows:
                tr.write(f"{t.utt_id}\t{t.text}\n")
        with open(os.path.join(base, split, "segments.txt"), "w", encoding="utf-8") as seg:
            for t in rows:
                source = f"espeak-ng:{LANGUAGE_CODES[language]}+{t.voice.variant}"
                seg.write(f"{t.utt_id}\t{source}\t0.00\t{durations[t.utt_id]:.2f}\n")
        for t in rows:
            key = (t.speaker, t.book, split)
            entry = meta.setdefault(key, {"minutes": 0.0, "voice": t.voice})
            entry["minutes"] += durations[t.utt_id] / 60.0
    with open(os.path.join(base, "metainfo.txt"), "w", encoding="utf-8") as handle:
        handle.write(METAINFO_HEADER + "\n")
        for (speaker, book, split), entry in sorted(meta.items()):
            voice = entry["voice"]
            fields = (
                str(speaker),
                "F" if voice.gender == "female" else "M",
                split,
                f"{entry['minutes']:.3f}",
                str(book),
                f"Synthetic Book {book}",
                f"espeak-ng {voice.variant} p{voice.pitch} r{voice.rate}",
            )
            handle.write(
                " | ".join(f.center(w) for f, w in zip(fields, _WIDTHS, strict=True)) + "\n"
            )


def _summary(tasks: list[_Task], durations: dict) -> dict:
    out: dict = {}
    for t in tasks:
        s = out.setdefault(t.language, {}).setdefault(
            t.split, {"speakers": set(), "utterances": 0, "hours": 0.0}
        )
        s["speakers"].add(t.speaker)
        s["utterances"] += 1
        s["hours"] += durations[t.utt_id] / 3600.0
    for splits in out.values():
        for s in splits.values():
            s["speakers"] = len(s["speakers"])
            s["hours"] = round(s["hours"], 4)
    return out


def _write_utterance(task: _Task, root: str) -> tuple[str, float]:
    """Synthesise one utterance into ``root`` (its MLS path); return (utt_id, seconds)."""
    wav = synthesize(task.text, task.voice.voice(LANGUAGE_CODES[task.language]))
    folder = os.path.join(
        root, f"mls_{task.language}", task.split, "audio", str(task.speaker), str(task.book)
    )
    os.makedirs(folder, exist_ok=True)
    sf.write(os.path.join(folder, f"{task.utt_id}.flac"), wav, SAMPLE_RATE, subtype="PCM_16")
    return task.utt_id, len(wav) / SAMPLE_RATE


def _one_thread_worker() -> None:
    """Process-pool initializer: one torch thread per worker (the pool is the parallelism)."""
    torch.set_num_threads(1)


def _write_batch(tasks: list[_Task], root: str) -> list[tuple[str, float]]:
    return [_write_utterance(task, root) for task in tasks]


def _synthesize_all(tasks: list[_Task], root: str, *, workers: int, progress: bool) -> dict:
    """Write every task's audio under ``root`` with ``workers`` processes; {utt_id: seconds}.

    Each synthesis call loads its own copy of libespeak-ng (:mod:`.espeak`), so an utterance's
    samples do not depend on the process or on what was synthesised before it: the corpus is
    the same file for file whatever ``workers`` is. Workers are spawned (not forked) so that no
    OpenMP or espeak-ng state of the parent is inherited.
    """
    durations = {}
    bar = tqdm(total=len(tasks), desc="espeak-ng MLS corpus", unit="utt", disable=not progress)
    with bar:
        if workers <= 1:
            for task in tasks:
                utt_id, seconds = _write_utterance(task, root)
                durations[utt_id] = seconds
                bar.update(1)
            return durations
        size = 32  # tasks per job: amortises the inter-process round trip
        batches = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        with ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_one_thread_worker,
        ) as pool:
            for written in pool.map(_write_batch, batches, [root] * len(batches)):
                durations.update(written)
                bar.update(len(written))
    return durations


@contextlib.contextmanager
def _restore_threads(threads: int):
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def generate_mls_corpus(
    out_dir: str,
    *,
    languages: list[str] | tuple[str, ...] = LANGUAGES,
    speakers_per_language: int = 6,
    utterances_per_speaker: int = 20,
    seed: int = 1234,
    public_speakers_per_language: int = 3,
    public_utterances_per_speaker: int = 30,
    dev_speakers: int = 2,
    test_speakers: int = 2,
    test_overlap_speakers: int = 1,
    eval_utterances_per_speaker: int = 8,
    speaker_size_spread: float = 0.5,
    public_test_speakers: int = 4,
    client_novel_share: float = 0.0,
    client_rate: tuple[int, int] = (140, 230),
    progress: bool = True,
    num_workers: int | None = None,
) -> dict:
    """Generate (or reuse) the embedded multilingual corpus in the real MLS layout.

    Arguments
    ---------
    out_dir : str
        Corpus root; ``mls_<language>/`` folders are created inside it.
    languages : sequence of str
        MLS language names (default: all 8).
    speakers_per_language : int
        Training speakers per language (one federated client each under the speaker partition).
    utterances_per_speaker : int
        Mean training utterances per speaker (scaled per speaker by ``speaker_size_spread``).
    seed : int
        Random seed: the same options and seed give the same corpus, file for file.
    public_speakers_per_language, public_utterances_per_speaker : int
        Size of the ``public`` split (speakers disjoint from every other split).
    dev_speakers, test_speakers : int
        Speakers only in dev / only in test.
    test_overlap_speakers : int
        Training speakers who also read another book in test (MLS-like overlap, Appendix B).
    eval_utterances_per_speaker : int
        Utterances per speaker in dev and test.
    speaker_size_spread : float
        Training utterance counts are scaled by U(1 - spread, 1 + spread) per speaker.
    public_test_speakers : int
        Public-domain speakers (text, variants and rates of the public split, speakers of their
        own) in the ``public_test`` split, ``eval_utterances_per_speaker`` each: the seed
        model's held-out in-domain test.
    client_novel_share : float
        Probability that a slot of a client-domain sentence (train, dev, test) is filled with
        a phrase the public split never has (``speechbrain_fl/data/sentences.py``). Default 0:
        at 0.3 the seed model's test WER rises from 0.45 (public domain) to 0.65, but neither
        the federated stage nor central LoRA adaptation on the pooled client data lowers it
        (measurements in ``docs/mls_embedded_corpus.md``).
    client_rate : (int, int)
        Speaking-rate window (words per minute) of client-domain speakers; public speakers
        read at :data:`PUBLIC_RATE`.
    progress : bool
        Show a tqdm progress bar.
    num_workers : int or None
        Processes synthesising in parallel (None: one per CPU core, ``os.cpu_count()``). The
        corpus is the same whatever the count; only the time changes.

    Returns
    -------
    dict
        ``{"path", "cached", "seconds", "options", "summary": {language: {split:
        {"speakers", "utterances", "hours"}}}}``.
    """
    options = _checked_options(
        languages=languages,
        speakers_per_language=speakers_per_language,
        utterances_per_speaker=utterances_per_speaker,
        seed=seed,
        public_speakers_per_language=public_speakers_per_language,
        public_utterances_per_speaker=public_utterances_per_speaker,
        dev_speakers=dev_speakers,
        test_speakers=test_speakers,
        test_overlap_speakers=test_overlap_speakers,
        eval_utterances_per_speaker=eval_utterances_per_speaker,
        speaker_size_spread=speaker_size_spread,
        public_test_speakers=public_test_speakers,
        client_novel_share=client_novel_share,
        client_rate=client_rate,
        num_workers=num_workers,
    )
    out_dir = os.path.abspath(out_dir)
    cached = cached_stamp(out_dir, STAMP_FILE, options, name="MLS")
    if cached is not None:
        return cached
    workers = max(1, int(num_workers if num_workers is not None else (os.cpu_count() or 1)))
    return _build_corpus(out_dir, options, workers=workers, progress=progress)


def _checked_options(
    *,
    languages: list[str] | tuple[str, ...],
    speakers_per_language: int,
    utterances_per_speaker: int,
    seed: int,
    public_speakers_per_language: int,
    public_utterances_per_speaker: int,
    dev_speakers: int,
    test_speakers: int,
    test_overlap_speakers: int,
    eval_utterances_per_speaker: int,
    speaker_size_spread: float,
    public_test_speakers: int,
    client_novel_share: float,
    client_rate: tuple[int, int],
    num_workers: int | None,
) -> dict:
    """The corpus options of :func:`generate_mls_corpus` as its stamp records them.

    ``ValueError`` naming the argument at fault for an unknown language, fewer than one speaker
    or utterance per speaker or worker, a spread outside [0, 1), a novel share outside [0, 1],
    a rate window outside [80, 450] wpm, or more than 999 speakers per language.
    """
    unknown = [lang for lang in languages if lang not in LANGUAGE_CODES]
    if unknown:
        raise ValueError(f"unknown MLS language(s) {unknown}; choose from {list(LANGUAGES)}")
    for key, value in (
        ("speakers_per_language", speakers_per_language),
        ("utterances_per_speaker", utterances_per_speaker),
    ):
        if int(value) < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if num_workers is not None and int(num_workers) < 1:
        raise ValueError(f"num_workers must be >= 1 (or None: one per core), got {num_workers}")
    if not 0 <= speaker_size_spread < 1:
        raise ValueError(f"speaker_size_spread must be in [0, 1), got {speaker_size_spread}")
    if not 0.0 <= client_novel_share <= 1.0:
        raise ValueError(f"client_novel_share must be in [0, 1], got {client_novel_share}")
    if len(client_rate) != 2 or not 80 <= client_rate[0] <= client_rate[1] <= 450:
        raise ValueError(f"client_rate must be (low, high) inside [80, 450] wpm, got {client_rate}")
    total = (
        speakers_per_language
        + dev_speakers
        + test_speakers
        + public_speakers_per_language
        + public_test_speakers
    )
    if total + test_overlap_speakers > 999:
        # Speaker ids are 10000 * (language + 1) + 10 * k + r and books 100000 + 1000 * language
        # + role: more than 999 speakers per language would collide with the next language.
        raise ValueError(
            "at most 999 speakers per language (train + dev + test + public + public_test), "
            f"got {total}"
        )
    options = {
        "version": _VERSION,
        "languages": list(languages),
        "speakers_per_language": int(speakers_per_language),
        "utterances_per_speaker": int(utterances_per_speaker),
        "seed": int(seed),
        "public_speakers_per_language": int(public_speakers_per_language),
        "public_utterances_per_speaker": int(public_utterances_per_speaker),
        "dev_speakers": int(dev_speakers),
        "test_speakers": int(test_speakers),
        "test_overlap_speakers": int(test_overlap_speakers),
        "eval_utterances_per_speaker": int(eval_utterances_per_speaker),
        "speaker_size_spread": float(speaker_size_spread),
        "public_test_speakers": int(public_test_speakers),
        "client_novel_share": float(client_novel_share),
        "client_rate": [int(client_rate[0]), int(client_rate[1])],
        "sample_rate": SAMPLE_RATE,
    }
    return options


def _build_corpus(out_dir: str, options: dict, *, workers: int, progress: bool) -> dict:
    """Synthesise the corpus of ``options`` into ``out_dir`` (atomically) and stamp it.

    Returns
    -------
    dict
        The stamp (``options``, ``seconds``, ``summary``) with ``path`` and ``cached=False``.
    """
    start = time.perf_counter()
    tasks = _plan(options)
    logger.info(
        "Generating the embedded MLS corpus (%d utterances, %d process%s) in %s",
        len(tasks),
        workers,
        "" if workers == 1 else "es",
        out_dir,
    )
    # One torch thread for the per-utterance resampling: on a busy machine, intra-op threads
    # cost more in synchronisation than a 3-second resample gains (measured 5x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with _restore_threads(threads), atomic_folder(out_dir) as tmp:
        tmp = str(tmp)
        durations = _synthesize_all(tasks, tmp, workers=workers, progress=progress)
        for language in options["languages"]:
            _write_language(tmp, language, [t for t in tasks if t.language == language], durations)
        result = {
            "options": options,
            "seconds": round(time.perf_counter() - start, 2),
            "summary": _summary(tasks, durations),
        }
        with open(os.path.join(tmp, STAMP_FILE), "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    logger.info("Embedded MLS corpus written in %.1f s.", result["seconds"])
    return {**result, "path": out_dir, "cached": False}

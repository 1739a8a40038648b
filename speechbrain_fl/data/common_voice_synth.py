"""The embedded Common Voice-layout corpus: espeak-ng speakers with gender, age and accent.

``generate_common_voice_corpus`` writes what a Common Voice language archive unpacks to, so
``recipes/Private-Gender/common_voice_prepare.py`` runs unchanged on it::

    <out_dir>/train.tsv  dev.tsv  test.tsv  validated.tsv
    <out_dir>/clips/common_voice_en_<n>.mp3

The TSV columns are those of the 2024 and later releases (Common Voice 17+): ``client_id, path,
sentence_id, sentence, sentence_domain, up_votes, down_votes, age, gender, accents, variant,
locale, segment``; with ``release_style="legacy"`` they are the older ones (``accent`` instead
of ``accents``, no sentence id/domain/variant) with the older gender values.
``validated.tsv`` holds every clip of the three splits plus clips of speakers in no split, as in
the real releases (whose train/dev/test are speaker-disjoint subsets of ``validated.tsv``).
Clips are MP3 (the real format) written by libsndfile (``soundfile`` >= 0.12 reads and writes
MPEG layer III); ``audio_format="wav"`` writes WAV instead (the prepare accepts both).

**How labels relate to the metadata** (our construction; the paper names no dataset). Each
speaker first draws a class, male / female / other, with probabilities ``class_shares``
(default 0.70 / 0.25 / 0.05, stratified in every split). The voice then depends on the class
only: male and female speakers use the male and female espeak-ng variants of
:mod:`speechbrain_fl.data.voices` with their pitch windows; "other" speakers use a distinct pool
of variants (:data:`OTHER_VARIANTS`) with an intermediate pitch window. The variants are cycled
per split and class, so every split with at least as many speakers of a class as the class has
variants hears all of them (:func:`voice_coverage` reports it). Age and accent are drawn *given
the class* from the tables :data:`AGE_GIVEN_CLASS` and :data:`ACCENT_GIVEN_CLASS`, so the
metadata is informative about the label (a privileged input a teacher can lean on) but never
determines it: metadata alone reaches a balanced accuracy of at most :func:`metadata_ceiling`
(0.885 with the default tables). The accent also sets the espeak-ng English dialect.
Transcripts are drawn independently of everything else. A share ``unlabeled_share`` of
speakers leaves gender empty or "do_not_wish_to_say" (excluded by the prepare, and counted).
The gender *value* written for a class follows the release style: legacy
``male``/``female``/``other``; 2024+ ``male_masculine``/``female_feminine`` and, for "other",
one of ``non-binary``/``transgender``/``intersex``. One clip per speaker by default
(``clips_per_speaker``), so that a clip-level DP guarantee is a speaker-level one.

Generation is deterministic for a seed, atomic (a temporary sibling folder renamed at the end)
and cached by a stamp of its options. A SIGTERM during generation (a scheduler's kill, ``timeout``)
raises ``SystemExit(143)`` after the clip being written, in the main thread, so the temporary
``.<name>.*.tmp`` folder is removed as on any exception, instead of being left behind (it
reached 535 MB for the Private-Gender default); a handler installed by the application is
left in place.

Example
-------
>>> import tempfile, os
>>> out = os.path.join(tempfile.mkdtemp(), "cv")
>>> info = generate_common_voice_corpus(out, speakers={"train": 4, "dev": 2, "test": 2,
...     "validated_only": 1}, clips_per_speaker=1, progress=False)
>>> sorted(os.listdir(out))[:5]
['.cv_synth.json', 'clips', 'dev.tsv', 'test.tsv', 'train.tsv']
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from tqdm.auto import tqdm

from speechbrain_fl.data.corpus_cache import cached_stamp
from speechbrain_fl.data.espeak import SAMPLE_RATE, list_variants, synthesize
from speechbrain_fl.data.sentences import make_sentences
from speechbrain_fl.data.voices import FEMALE_VARIANTS, MALE_VARIANTS, SpeakerVoice
from speechbrain_fl.utils.atomic import atomic_folder

__all__ = [
    "ACCENT_GIVEN_CLASS",
    "AGE_GIVEN_CLASS",
    "CLASSES",
    "COLUMNS",
    "LEGACY_COLUMNS",
    "OTHER_VARIANTS",
    "STAMP_FILE",
    "generate_common_voice_corpus",
    "metadata_ceiling",
    "voice_coverage",
]

logger = logging.getLogger(__name__)

STAMP_FILE = ".cv_synth.json"
_VERSION = 2  # 2: voices cycled per split and class, sharper metadata tables
CLASSES = ("male", "female", "other")
SPLITS = ("train", "dev", "test", "validated_only")

#: Columns of the 2024+ releases (Common Voice 17.0 and later).
COLUMNS = (
    "client_id", "path", "sentence_id", "sentence", "sentence_domain", "up_votes",
    "down_votes", "age", "gender", "accents", "variant", "locale", "segment",
)  # fmt: skip
#: Columns of the older releases (before the 2024 gender options).
LEGACY_COLUMNS = (
    "client_id", "path", "sentence", "up_votes", "down_votes", "age", "gender", "accent",
    "locale", "segment",
)  # fmt: skip

#: Gender values written per class; 2024+ "other" speakers pick one of three values.
_GENDER_VALUES = {
    "legacy": {"male": ("male",), "female": ("female",), "other": ("other",)},
    "2024": {
        "male": ("male_masculine",),
        "female": ("female_feminine",),
        "other": ("non-binary", "transgender", "intersex"),
    },
}
_UNLABELED_VALUES = {"legacy": ("",), "2024": ("", "do_not_wish_to_say")}

#: Variants of the "other" class: human-like espeak-ng variants in neither gendered pool.
OTHER_VARIANTS = ("klatt", "klatt2", "klatt3", "Gene", "Jacky", "Nguyen", "Reed", "adam")
_PITCH = {"male": (20, 50), "female": (50, 80), "other": (35, 65)}
_RATE = (140, 200)
_RANGE = (30, 75)

_AGES = ("teens", "twenties", "thirties", "fourties", "fifties", "sixties")  # CV's spelling
#: P(age | class), our choice: informative about the class, never a function of it.
AGE_GIVEN_CLASS = {
    "male": (0.01, 0.04, 0.10, 0.25, 0.35, 0.25),
    "female": (0.02, 0.45, 0.43, 0.06, 0.03, 0.01),
    "other": (0.70, 0.25, 0.02, 0.01, 0.01, 0.01),
}
#: Common Voice accent label -> espeak-ng English dialect.
_ACCENTS = {
    "United States English": "en-us",
    "England English": "en-gb-x-rp",
    "Scottish English": "en-gb-scotland",
    "West Indies and Bermuda (Bahamas, Bermuda, Jamaica, Trinidad)": "en-029",
}
#: P(accent | class), our choice (same remark as for the age).
ACCENT_GIVEN_CLASS = {
    "male": (0.80, 0.10, 0.07, 0.03),
    "female": (0.10, 0.78, 0.04, 0.08),
    "other": (0.04, 0.08, 0.18, 0.70),
}


def metadata_ceiling(
    age_given_class: dict | None = None, accent_given_class: dict | None = None
) -> float:
    """Best balanced accuracy a classifier of the metadata alone (age, accent) can reach.

    Age and accent are drawn independently given the class, so with a uniform class prior
    (balanced accuracy weighs the classes equally) the Bayes rule predicts
    ``argmax_c P(age | c) P(accent | c)`` and its balanced accuracy is

        (1 / K) * sum_{age, accent} max_c P(age | c) P(accent | c).

    Example
    -------
    >>> round(metadata_ceiling(), 3)
    0.885
    """
    ages = AGE_GIVEN_CLASS if age_given_class is None else age_given_class
    accents = ACCENT_GIVEN_CLASS if accent_given_class is None else accent_given_class
    classes = list(ages)
    total = 0.0
    for i in range(len(ages[classes[0]])):
        for j in range(len(accents[classes[0]])):
            total += max(ages[c][i] * accents[c][j] for c in classes)
    return total / len(classes)


@dataclass(frozen=True)
class _Speaker:
    client_id: str
    split: str
    label: str | None  # None: unlabeled
    gender_value: str
    age: str
    accent: str
    voice: SpeakerVoice


def _pool(label: str) -> list[str]:
    wanted = {"male": MALE_VARIANTS, "female": FEMALE_VARIANTS, "other": OTHER_VARIANTS}[label]
    available = set(list_variants())
    pool = [v for v in wanted if v in available]
    if not pool:
        raise RuntimeError(f"no espeak-ng variant of the {label!r} pool is installed")
    return pool


def _speakers(options: dict) -> list[_Speaker]:
    rng = np.random.default_rng([options["seed"], 4241])
    style = options["release_style"]
    shares = np.asarray(options["class_shares"], dtype=float)
    pools = {c: list(rng.permutation(_pool(c))) for c in CLASSES}
    used: set[tuple] = set()
    out = []
    for split in SPLITS:
        n = options["speakers"].get(split, 0)
        # Stratified class counts per split (largest remainder), so every split keeps the
        # imbalance even when small: each class gets at least one speaker when n >= 3.
        raw = shares * n
        counts = np.floor(raw).astype(int)
        for i in np.argsort(raw - counts)[::-1][: n - counts.sum()]:
            counts[i] += 1
        if n >= len(CLASSES):
            for i in range(len(CLASSES)):
                if counts[i] == 0:
                    counts[int(np.argmax(counts))] -= 1
                    counts[i] = 1
        labels = [c for c, k in zip(CLASSES, counts, strict=True) for _ in range(k)]
        labels = [labels[i] for i in rng.permutation(len(labels))]
        # Voices cycle through each class's pool *within the split*: every split with at least
        # len(pool) speakers of a class covers all of that class's voices (D_aux and test hear
        # the same voices per class; with a global index they did not).
        seen = dict.fromkeys(CLASSES, 0)
        for label in labels:
            k = len(out)
            variant = str(pools[label][seen[label] % len(pools[label])])
            seen[label] += 1
            while True:
                pitch = int(rng.integers(*_PITCH[label], endpoint=True))
                rate = int(rng.integers(*_RATE, endpoint=True))
                if (variant, pitch, rate) not in used:
                    used.add((variant, pitch, rate))
                    break
            pitch_range = int(rng.integers(*_RANGE, endpoint=True))
            age = _AGES[int(rng.choice(len(_AGES), p=AGE_GIVEN_CLASS[label]))]
            accent = list(_ACCENTS)[int(rng.choice(len(_ACCENTS), p=ACCENT_GIVEN_CLASS[label]))]
            values = _GENDER_VALUES[style][label]
            value = values[int(rng.integers(len(values)))]
            unlabeled = rng.random() < options["unlabeled_share"]
            if unlabeled:
                empty = _UNLABELED_VALUES[style]
                value = empty[int(rng.integers(len(empty)))]
            client_id = f"{int(rng.integers(2**62)):016x}{k:04d}"
            out.append(
                _Speaker(
                    client_id=client_id,
                    split=split,
                    label=None if unlabeled else label,
                    gender_value=value,
                    age=age,
                    accent=accent,
                    voice=SpeakerVoice(variant, label, pitch, rate, pitch_range),
                )
            )
    return out


def voice_coverage(info: dict, *, covered: str = "test", by: str = "dev") -> dict:
    """Per class, the voices (espeak-ng variants) of split ``covered`` that split ``by`` has.

    ``info`` is what :func:`generate_common_voice_corpus` returns (its ``voices`` block). The
    student learns from D_aux (``dev``) only, so a test voice D_aux never has caps its recall.

    Returns
    -------
    dict
        ``{class: {"voices": n, "covered": n, "missing": [variants], "min_speakers_by": n}}``,
        ``min_speakers_by`` the fewest speakers ``by`` has of any of the class's voices there.
    """
    voices = info["voices"]
    out = {}
    for label in CLASSES:
        wanted = voices.get(covered, {}).get(label, {})
        have = voices.get(by, {}).get(label, {})
        missing = sorted(v for v in wanted if v not in have)
        out[label] = {
            "voices": len(wanted),
            "covered": len(wanted) - len(missing),
            "missing": missing,
            "min_speakers_by": min(have.values()) if have else 0,
        }
    return out


@contextlib.contextmanager
def _sigterm_checkpoints() -> Iterator[Callable[[], None]]:
    """While active, a SIGTERM is recorded and the yielded ``check()`` raises
    ``SystemExit(128 + SIGTERM)`` at the next call, so ``atomic_folder``'s cleanup runs on a kill.

    The handler only records the signal: raising from it directly could happen inside
    espeak-ng's ctypes callback, where Python prints and drops the exception. Main thread and
    default handler only; otherwise ``check()`` does nothing and the application's handling
    stays in place.
    """
    received: list[int] = []

    def check() -> None:
        if received:
            raise SystemExit(128 + received[0])

    if threading.current_thread() is not threading.main_thread():
        yield check
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield check
        return

    def handler(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield check
    finally:
        signal.signal(signal.SIGTERM, previous)
        check()  # a signal after the last clip still ends the process, as the default would


def _row(style: str, speaker: _Speaker, path: str, sentence: str, sentence_id: str) -> dict:
    common = {
        "client_id": speaker.client_id,
        "path": path,
        "sentence": sentence,
        "up_votes": "2",
        "down_votes": "0",
        "age": speaker.age,
        "gender": speaker.gender_value,
        "locale": "en",
        "segment": "",
    }
    if style == "legacy":
        return {**common, "accent": speaker.accent}
    return {
        **common,
        "sentence_id": sentence_id,
        "sentence_domain": "",
        "accents": speaker.accent,
        "variant": "",
    }


def generate_common_voice_corpus(
    out_dir: str,
    *,
    speakers: dict[str, int] | None = None,
    clips_per_speaker: int = 1,
    class_shares: tuple[float, float, float] = (0.70, 0.25, 0.05),
    unlabeled_share: float = 0.03,
    release_style: str = "2024",
    audio_format: str = "mp3",
    seed: int = 1234,
    progress: bool = True,
) -> dict:
    """Generate (or reuse) the embedded corpus in the Common Voice layout.

    Arguments
    ---------
    out_dir : str
        Corpus root (``clips/`` and the TSV files are created inside it).
    speakers : dict
        Speakers per split: ``train``, ``dev``, ``test`` and ``validated_only`` (in
        ``validated.tsv`` only). Default ``{"train": 400, "dev": 150, "test": 150,
        "validated_only": 100}``.
    clips_per_speaker : int
        Clips recorded by each speaker.
    class_shares : tuple of float
        P(male), P(female), P(other) of a speaker (stratified in every split).
    unlabeled_share : float
        Probability that a speaker's gender is left empty / "do_not_wish_to_say".
    release_style : str
        ``"2024"`` (columns and gender values of Common Voice 17+) or ``"legacy"``.
    audio_format : str
        ``"mp3"`` (as the real releases) or ``"wav"``.
    seed : int
        Same options and seed, same corpus.
    progress : bool
        Show a tqdm bar.

    Returns
    -------
    dict
        ``{"path", "cached", "seconds", "options", "summary": {split: {class: clips}}}``.
    """
    options = _checked_options(
        speakers=speakers,
        clips_per_speaker=clips_per_speaker,
        class_shares=class_shares,
        unlabeled_share=unlabeled_share,
        release_style=release_style,
        audio_format=audio_format,
        seed=seed,
    )
    out_dir = os.path.abspath(out_dir)
    cached = cached_stamp(out_dir, STAMP_FILE, options, name="Common Voice")
    if cached is not None:
        return cached
    return _build_corpus(out_dir, options, progress=progress)


def _checked_options(
    *,
    speakers: dict[str, int] | None,
    clips_per_speaker: int,
    class_shares: tuple[float, float, float],
    unlabeled_share: float,
    release_style: str,
    audio_format: str,
    seed: int,
) -> dict:
    """The corpus options of :func:`generate_common_voice_corpus` as its stamp records them.

    ``ValueError`` naming the argument at fault for an unknown split, release style or audio
    format, class shares that are not 3 non-negative numbers summing to 1, or fewer than one
    clip per speaker.
    """
    speakers = dict(speakers or {"train": 400, "dev": 150, "test": 150, "validated_only": 100})
    unknown = sorted(set(speakers) - set(SPLITS))
    if unknown:
        raise ValueError(f"speakers: unknown split(s) {unknown}; expected keys of {SPLITS}")
    if release_style not in _GENDER_VALUES:
        raise ValueError(f"release_style must be 'legacy' or '2024', got {release_style!r}")
    if audio_format not in ("mp3", "wav"):
        raise ValueError(f"audio_format must be 'mp3' or 'wav', got {audio_format!r}")
    shares = [float(s) for s in class_shares]
    if len(shares) != 3 or min(shares) < 0 or abs(sum(shares) - 1) > 1e-6:
        raise ValueError(f"class_shares must be 3 non-negative shares summing to 1, got {shares}")
    if int(clips_per_speaker) < 1:
        raise ValueError(f"clips_per_speaker must be >= 1, got {clips_per_speaker}")
    return {
        "version": _VERSION,
        "speakers": {k: int(v) for k, v in sorted(speakers.items())},
        "clips_per_speaker": int(clips_per_speaker),
        "class_shares": shares,
        "unlabeled_share": float(unlabeled_share),
        "release_style": release_style,
        "audio_format": audio_format,
        "seed": int(seed),
        "sample_rate": SAMPLE_RATE,
    }


def _build_corpus(out_dir: str, options: dict, *, progress: bool) -> dict:
    """Synthesise the corpus of ``options`` into ``out_dir`` (atomically) and stamp it.

    A SIGTERM during synthesis exits at the next clip and removes the temporary folder.

    Returns
    -------
    dict
        The stamp (``options``, ``seconds``, ``summary``, ``voices``) with ``path`` and
        ``cached=False``.
    """
    start = time.perf_counter()
    spk = _speakers(options)
    n_clips = len(spk) * options["clips_per_speaker"]
    texts = make_sentences("english", n_clips, seed=options["seed"])
    columns = COLUMNS if options["release_style"] == "2024" else LEGACY_COLUMNS
    voices = _voice_counts(spk)
    logger.info("Generating the embedded Common Voice corpus (%d clips) in %s", n_clips, out_dir)
    with _sigterm_checkpoints() as check_terminated, atomic_folder(out_dir) as tmp:
        os.makedirs(tmp / "clips")
        rows, summary = _write_clips(
            tmp, spk, texts, options, progress=progress, check_terminated=check_terminated
        )
        _write_tsvs(tmp, rows, columns)
        result = {
            "options": options,
            "seconds": round(time.perf_counter() - start, 2),
            "summary": summary,
            "voices": voices,
        }
        with open(tmp / STAMP_FILE, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    logger.info("Embedded Common Voice corpus written in %.1f s.", result["seconds"])
    return {**result, "path": out_dir, "cached": False}


def _voice_counts(spk: list[_Speaker]) -> dict[str, dict[str, dict[str, int]]]:
    """``{split: {gender: {espeak-ng variant: speakers}}}``, recorded in the stamp."""
    voices: dict[str, dict[str, dict[str, int]]] = {}
    for speaker in spk:
        per_class = voices.setdefault(speaker.split, {}).setdefault(speaker.voice.gender, {})
        per_class[speaker.voice.variant] = per_class.get(speaker.voice.variant, 0) + 1
    return voices


def _write_clips(
    tmp: Path,
    spk: list[_Speaker],
    texts: list[str],
    options: dict,
    *,
    progress: bool,
    check_terminated: Callable[[], None],
) -> tuple[dict[str, list[dict]], dict[str, dict[str, int]]]:
    """Synthesise every speaker's clips into ``tmp/clips``.

    Clip ``n = speaker index * clips_per_speaker + c`` reads ``texts[n]`` with seed ``n``.

    Returns
    -------
    rows : dict
        Per split, the TSV rows of its clips.
    summary : dict
        ``{split: {class or "unlabeled": clips}}``.
    """
    release_style, audio_format = options["release_style"], options["audio_format"]
    per_speaker = options["clips_per_speaker"]
    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    summary: dict[str, dict[str, int]] = {}
    n_clips = len(spk) * per_speaker
    bar = tqdm(total=n_clips, desc="espeak-ng CV corpus", unit="clip", disable=not progress)
    for s_index, speaker in enumerate(spk):
        voice = speaker.voice.voice(_ACCENTS[speaker.accent])
        for c in range(per_speaker):
            n = s_index * per_speaker + c
            name = f"common_voice_en_{40000000 + n}.{audio_format}"
            wav = synthesize(texts[n], voice, seed=n)
            if audio_format == "mp3":
                sf.write(tmp / "clips" / name, wav, SAMPLE_RATE, format="MP3")
            else:
                sf.write(tmp / "clips" / name, wav, SAMPLE_RATE, subtype="PCM_16")
            rows[speaker.split].append(_row(release_style, speaker, name, texts[n], f"{n:x}"))
            key = speaker.label or "unlabeled"
            summary.setdefault(speaker.split, {}).setdefault(key, 0)
            summary[speaker.split][key] += 1
            bar.update()
            check_terminated()  # SIGTERM: SystemExit here, the temporary folder is removed
    bar.close()
    return rows, summary


def _write_tsvs(tmp: Path, rows: dict[str, list[dict]], columns: Sequence[str]) -> None:
    """``train.tsv``, ``dev.tsv``, ``test.tsv`` and ``validated.tsv`` (every split's rows)."""
    for split in ("train", "dev", "test", "validated"):
        members = [r for s in SPLITS for r in rows[s]] if split == "validated" else rows[split]
        with open(tmp / f"{split}.tsv", "w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(
                handle, fieldnames=columns, delimiter="\t", quoting=csv.QUOTE_NONE,
                escapechar="\\", lineterminator="\n",
            )  # fmt: skip
            writer.writeheader()
            writer.writerows(members)

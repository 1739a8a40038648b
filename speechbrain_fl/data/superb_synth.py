"""Embedded SUPERB corpora: espeak-ng speech written in the real corpora's on-disk layouts.

Each generator writes what the real corpus unpacks to, so the recipe's prepare scripts
(``recipes/SUPERB/*_prepare.py``) run unchanged on it:

- :func:`generate_speech_commands` (KWS): Speech Commands v0.01 / v0.02,
  ``<word>/<speaker-hash>_nohash_<k>.wav`` (1 s, 16 kHz), ``validation_list.txt``,
  ``testing_list.txt`` (split by speaker, as the real lists are) and ``_background_noise_/``.
  Keywords are spoken by many synthetic voices; each clip is the word at a random offset in
  one second, mixed with a crop of a background-noise file at a random SNR (ours).
- :func:`generate_librispeech` (ASR, and the seed-model corpus): ``LibriSpeech/<split>/<spk>/
  <chapter>/<spk>-<chapter>-<utt>.flac`` with ``<spk>-<chapter>.trans.txt`` (upper-case
  transcripts) and ``SPEAKERS.TXT``. A ``public`` split (not in real LibriSpeech; its voices
  are disjoint from every other corpus here) pretrains the tiny seed model, the way the paper's
  initialisation was fine-tuned on LibriSpeech 100 h.
- VoxCeleb1 (SID, ASV) and IEMOCAP (ER): :mod:`speechbrain_fl.data.superb_synth_speakers`.

Generation is deterministic for a seed, written atomically (a temporary sibling folder renamed
at the end) and cached: a stamp file records the options; other options regenerate.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import soundfile as sf
from tqdm.auto import tqdm

from speechbrain_fl.data.corpus_cache import cached_stamp
from speechbrain_fl.data.espeak import SAMPLE_RATE, Voice, synthesize
from speechbrain_fl.data.sentences import make_sentences
from speechbrain_fl.data.voices import make_speakers
from speechbrain_fl.utils.atomic import atomic_folder

__all__ = [
    "COMMANDS",
    "EMOTION_PROSODY",
    "SC_WORDS",
    "STAMP_FILE",
    "generate_librispeech",
    "generate_speech_commands",
]

logger = logging.getLogger(__name__)

STAMP_FILE = ".superb_synth.json"
_VERSION = 1

#: The 10 command words of KWS-12 (SUPERB's KS task).
COMMANDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
_V1_OTHERS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "bed", "bird", "cat", "dog", "happy", "house", "marvin", "sheila", "tree", "wow",
)  # fmt: skip
#: Words of Speech Commands v0.01 (30) and v0.02 (35).
SC_WORDS = {
    1: COMMANDS + _V1_OTHERS,
    2: COMMANDS + _V1_OTHERS + ("backward", "forward", "follow", "learn", "visual"),
}
_NOISES = ("white_noise", "pink_noise", "brown_noise")

#: IEMOCAP emotion label -> prosody preset of :data:`speechbrain_fl.data.voices.PROSODY_PRESETS`
#: (ours). ``exc`` uses the same preset as ``hap``: the recipe merges them, as SUPERB does.
EMOTION_PROSODY = {
    "neu": "neutral",
    "hap": "excited",
    "exc": "excited",
    "sad": "sad",
    "ang": "fast",
    "fru": "monotone",
}


# --------------------------------------------------------------------------- caching
def _cached(out_dir: str, options: dict, build: Callable[[str], dict], *, name: str) -> dict:
    """Return the stamp of a corpus built by ``build(tmp_dir)`` with ``options`` (cached)."""
    out_dir = os.path.abspath(out_dir)
    options = {"version": _VERSION, "sample_rate": SAMPLE_RATE, **options}
    cached = cached_stamp(out_dir, STAMP_FILE, options, name=name)
    if cached is not None:
        return cached
    start = time.perf_counter()
    with atomic_folder(out_dir) as tmp:
        summary = build(str(tmp))
        stamp = {
            "options": options,
            "seconds": round(time.perf_counter() - start, 2),
            "summary": summary,
        }
        with open(os.path.join(tmp, STAMP_FILE), "w", encoding="utf-8") as handle:
            json.dump(stamp, handle, indent=2)
    logger.info("Embedded %s corpus written to %s in %.1f s.", name, out_dir, stamp["seconds"])
    return {**stamp, "path": out_dir, "cached": False}


def _jitter(voice: Voice, rng: np.random.Generator, scale: float = 0.08) -> Voice:
    """The same speaker with a slightly different rate and pitch (one more take)."""
    return Voice(
        language=voice.language,
        variant=voice.variant,
        rate=int(np.clip(round(voice.rate * rng.uniform(1 - scale, 1 + scale)), 80, 450)),
        pitch=int(np.clip(voice.pitch + rng.integers(-3, 4), 0, 100)),
        pitch_range=voice.pitch_range,
    )


def _noise(kind: str, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """White, pink (1/f) or brown (1/f^2) noise, peak-normalised to 0.5."""
    n = int(seconds * SAMPLE_RATE)
    white = rng.standard_normal(n)
    if kind == "white_noise":
        out = white
    else:
        spectrum = np.fft.rfft(white)
        freqs = np.fft.rfftfreq(n, 1.0 / SAMPLE_RATE)
        freqs[0] = freqs[1]
        power = 0.5 if kind == "pink_noise" else 1.0
        out = np.fft.irfft(spectrum / freqs**power, n)
    return (0.5 * out / np.abs(out).max()).astype(np.float32)


def _write_wav(path: str, wav: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sf.write(path, np.clip(wav, -1.0, 1.0), SAMPLE_RATE, subtype="PCM_16")


# --------------------------------------------------------------------------- Speech Commands
def generate_speech_commands(
    out_dir: str,
    *,
    version: int = 1,
    train_speakers: int = 24,
    valid_speakers: int = 4,
    test_speakers: int = 6,
    repeats: int = 2,
    unknown_words_per_speaker: int = 4,
    noise_seconds: float = 20.0,
    snr_db: tuple[float, float] = (10.0, 30.0),
    seed: int = 1234,
    progress: bool = True,
) -> dict:
    """Generate (or reuse) a Speech Commands tree (v0.01 or v0.02 layout).

    Every speaker says each of the 10 command words ``repeats`` times and
    ``unknown_words_per_speaker`` other words of the version's vocabulary once (KWS-35 uses all
    words as classes, so for ``version=2`` every word is said ``repeats`` times).

    Arguments
    ---------
    out_dir : str
        Corpus root (the folder holding the word folders).
    version : int
        1 (30 words) or 2 (35 words).
    train_speakers, valid_speakers, test_speakers : int
        Speakers per split (listed by speaker in ``validation_list.txt`` / ``testing_list.txt``).
    repeats : int
        Takes of each word per speaker (``<hash>_nohash_<k>.wav``).
    unknown_words_per_speaker : int
        v0.01 only: non-command words per speaker.
    noise_seconds : float
        Length of each ``_background_noise_`` file.
    snr_db : tuple of float
        Range of the speech-to-noise ratio of each clip.
    seed : int
        Random seed.
    progress : bool
        tqdm bar.

    Returns
    -------
    dict
        The stamp: ``options``, ``seconds``, ``summary`` (clips per split), ``path``, ``cached``.

    Example
    -------
    >>> import tempfile
    >>> info = generate_speech_commands(tempfile.mkdtemp() + "/sc", train_speakers=1,
    ...     valid_speakers=1, test_speakers=1, repeats=1, unknown_words_per_speaker=1,
    ...     noise_seconds=2, progress=False)
    >>> sorted(info["summary"])
    ['test', 'train', 'validation']
    """
    if version not in SC_WORDS:
        raise ValueError(f"version must be 1 or 2, got {version}")
    options = {
        "corpus": "speech_commands",
        "version": version,
        "train_speakers": int(train_speakers),
        "valid_speakers": int(valid_speakers),
        "test_speakers": int(test_speakers),
        "repeats": int(repeats),
        "unknown_words_per_speaker": int(unknown_words_per_speaker),
        "noise_seconds": float(noise_seconds),
        "snr_db": [float(snr_db[0]), float(snr_db[1])],
        "seed": int(seed),
    }

    def build(tmp: str) -> dict:
        rng = np.random.default_rng([seed, 11, version])
        noises = _write_noises(tmp, noise_seconds, rng)
        roles = (
            ["train"] * train_speakers + ["validation"] * valid_speakers + ["test"] * test_speakers
        )
        voices = make_speakers(len(roles), seed=seed * 13 + version)
        plan = _speech_commands_plan(
            roles,
            voices,
            version=version,
            repeats=repeats,
            unknown_words_per_speaker=unknown_words_per_speaker,
            rng=rng,
        )
        lists = {"validation": [], "test": []}
        summary = {"train": 0, "validation": 0, "test": 0}
        for role, spk, voice, word, k in tqdm(
            plan, desc="espeak-ng Speech Commands", unit="clip", disable=not progress
        ):
            rel = f"{word}/{spk}_nohash_{k}.wav"
            clip = _command_clip(word, voice, take=k, noises=noises, snr_db=snr_db, rng=rng)
            _write_wav(os.path.join(tmp, rel), clip)
            summary[role] += 1
            if role in lists:
                lists[role].append(rel)
        _write_speech_commands_lists(tmp, lists, version=version)
        return summary

    return _cached(out_dir, options, build, name=f"Speech Commands v0.0{version}")


def _write_noises(tmp: str, seconds: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The ``_background_noise_`` files, one per noise colour, written and returned by kind."""
    noises = {}
    for kind in _NOISES:
        noises[kind] = _noise(kind, seconds, rng)
        _write_wav(os.path.join(tmp, "_background_noise_", f"{kind}.wav"), noises[kind])
    return noises


def _speech_commands_plan(
    roles: list[str],
    voices: list,
    *,
    version: int,
    repeats: int,
    unknown_words_per_speaker: int,
    rng: np.random.Generator,
) -> list[tuple]:
    """``(role, speaker hash, voice, word, take)`` of every clip, speaker by speaker.

    Each speaker gets a distinct random 8-hex-digit hash (the file names' ``<hash>``); v0.01
    speakers say the 10 commands ``repeats`` times and ``unknown_words_per_speaker`` other
    words once, v0.02 speakers every word ``repeats`` times.
    """
    words = SC_WORDS[version]
    hashes = set()
    plan = []
    for role, voice in zip(roles, voices, strict=True):
        while (spk := f"{int(rng.integers(16**8)):08x}") in hashes:
            pass
        hashes.add(spk)
        others = [w for w in words if w not in COMMANDS]
        if version == 1:
            chosen = [(w, repeats) for w in COMMANDS] + [
                (str(w), 1) for w in rng.choice(others, unknown_words_per_speaker, replace=False)
            ]
        else:
            chosen = [(w, repeats) for w in words]
        for word, takes in chosen:
            for k in range(takes):
                plan.append((role, spk, voice, word, k))
    return plan


def _command_clip(
    word: str,
    voice,
    *,
    take: int,
    noises: dict[str, np.ndarray],
    snr_db: tuple[float, float],
    rng: np.random.Generator,
) -> np.ndarray:
    """One second of ``word`` at a random offset plus background noise at a random SNR.

    The noise crop is scaled by ``g = sqrt(P_speech / P_noise / 10^(snr / 10))``, ``snr`` drawn
    uniformly from ``snr_db``, so that ``10 log10(P_speech / P_{g noise}) = snr``.
    """
    wav = synthesize(word, _jitter(voice.voice("en"), rng), seed=take)[:SAMPLE_RATE]
    clip = np.zeros(SAMPLE_RATE, dtype=np.float32)
    offset = int(rng.integers(0, SAMPLE_RATE - len(wav) + 1))
    clip[offset : offset + len(wav)] = wav
    noise = noises[_NOISES[int(rng.integers(len(_NOISES)))]]
    start = int(rng.integers(0, len(noise) - SAMPLE_RATE + 1))
    crop = noise[start : start + SAMPLE_RATE]
    snr = rng.uniform(*snr_db)
    gain = np.sqrt((wav**2).mean() / max((crop**2).mean(), 1e-12) / 10 ** (snr / 10))
    return clip + gain * crop


def _write_speech_commands_lists(tmp: str, lists: dict[str, list[str]], *, version: int) -> None:
    """``validation_list.txt``, ``testing_list.txt`` (sorted clip paths) and a README."""
    for role, name in (("validation", "validation_list.txt"), ("test", "testing_list.txt")):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as handle:
            handle.write("".join(f"{rel}\n" for rel in sorted(lists[role])))
    with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(
            f"Synthetic Speech Commands v0.0{version} (espeak-ng voices, speechbrain-fl).\n"
        )


# --------------------------------------------------------------------------- LibriSpeech
def generate_librispeech(
    out_dir: str,
    *,
    splits: dict[str, int] | None = None,
    utterances_per_speaker: int = 12,
    seed: int = 1234,
    speaker_offset: int = 1000,
    progress: bool = True,
) -> dict:
    """Generate (or reuse) a LibriSpeech tree: ``LibriSpeech/<split>/<spk>/<chapter>/...``.

    Arguments
    ---------
    out_dir : str
        Corpus root (the folder holding ``LibriSpeech/``).
    splits : dict of str to int
        Speakers per split, e.g. ``{"train-clean-100": 12, "dev-clean": 3, "test-clean": 3}``;
        a ``public`` split holds the seed model's pretraining speech.
    utterances_per_speaker : int
        Sentences per speaker (one chapter per speaker).
    seed : int
        Random seed.
    speaker_offset : int
        Index of the first synthetic voice (:func:`make_speakers` ``offset``), so two corpora
        generated with different offsets do not share voices.
    progress : bool
        tqdm bar.

    Returns
    -------
    dict
        The stamp (``summary``: utterances per split).

    Example
    -------
    >>> import tempfile
    >>> info = generate_librispeech(tempfile.mkdtemp() + "/ls", splits={"dev-clean": 1},
    ...     utterances_per_speaker=2, progress=False)
    >>> info["summary"]
    {'dev-clean': 2}
    """
    splits = dict(splits or {"train-clean-100": 12, "dev-clean": 3, "test-clean": 3})
    options = {
        "corpus": "librispeech",
        "splits": splits,
        "utterances_per_speaker": int(utterances_per_speaker),
        "seed": int(seed),
        "speaker_offset": int(speaker_offset),
    }

    def build(tmp: str) -> dict:
        total = sum(splits.values())
        voices = make_speakers(total, seed=seed, offset=speaker_offset)
        texts = make_sentences("english", total * utterances_per_speaker, seed=seed + 17)
        root = os.path.join(tmp, "LibriSpeech")
        summary, speakers_txt, cursor, index = {}, [], 0, 0
        plan = []
        for split, count in splits.items():
            summary[split] = 0
            for _ in range(count):
                spk, chapter = 100 + 7 * index, 1000 + index
                speakers_txt.append(
                    f"{spk:<5}| {'F' if voices[index].gender == 'female' else 'M'} | "
                    f"{split:<16}| 10.00 | espeak-ng {voices[index].variant}"
                )
                for u in range(utterances_per_speaker):
                    plan.append((split, spk, chapter, u, voices[index], texts[cursor]))
                    cursor += 1
                index += 1
        transcripts: dict[str, list[str]] = {}
        for split, spk, chapter, u, voice, text in tqdm(
            plan, desc="espeak-ng LibriSpeech", unit="utt", disable=not progress
        ):
            uid = f"{spk}-{chapter}-{u:04d}"
            folder = os.path.join(root, split, str(spk), str(chapter))
            os.makedirs(folder, exist_ok=True)
            sf.write(
                os.path.join(folder, f"{uid}.flac"),
                synthesize(text, voice.voice("en")),
                SAMPLE_RATE,
                subtype="PCM_16",
            )
            transcripts.setdefault(os.path.join(folder, f"{spk}-{chapter}.trans.txt"), []).append(
                f"{uid} {text.upper()}"
            )
            summary[split] += 1
        for path, lines in transcripts.items():
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
        with open(os.path.join(root, "SPEAKERS.TXT"), "w", encoding="utf-8") as handle:
            handle.write(";ID  |SEX| SUBSET          |MINUTES| NAME\n")
            handle.write("\n".join(speakers_txt) + "\n")
        return summary

    return _cached(out_dir, options, build, name="LibriSpeech")

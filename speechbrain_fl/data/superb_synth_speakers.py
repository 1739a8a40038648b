"""Embedded SUPERB speaker and emotion corpora: VoxCeleb1 (SID, ASV) and IEMOCAP (ER) layouts.

Like :mod:`speechbrain_fl.data.superb_synth` (deterministic for a seed, written atomically,
cached by a stamp of the options), in the real corpora's on-disk layouts:

- :func:`generate_voxceleb1` (SID, ASV): ``wav/id1xxxx/<video>/<nnnnn>.wav``,
  ``iden_split.txt`` (1 train, 2 dev, 3 test) and the trial list ``veri_test.txt`` over the
  last speakers (VoxCeleb1's 40 test speakers id10270-id10309 play this role).
- :func:`generate_iemocap` (ER): ``Session<n>/sentences/wav/<dialog>/<utt>.wav`` and
  ``Session<n>/dialog/EmoEvaluation/<dialog>.txt``; two speakers (F, M) per session, prosody
  presets as emotions (:data:`~speechbrain_fl.data.superb_synth.EMOTION_PROSODY`, ours).
"""

from __future__ import annotations

import os

import numpy as np
from tqdm.auto import tqdm

from speechbrain_fl.data.espeak import synthesize
from speechbrain_fl.data.sentences import make_sentences
from speechbrain_fl.data.superb_synth import EMOTION_PROSODY, _cached, _jitter, _write_wav
from speechbrain_fl.data.voices import apply_prosody, make_speakers

__all__ = ["generate_iemocap", "generate_voxceleb1"]


def generate_voxceleb1(
    out_dir: str,
    *,
    iden_speakers: int = 16,
    veri_speakers: int = 4,
    videos_per_speaker: int = 3,
    utterances_per_video: int = 3,
    trials_per_speaker: int = 6,
    seed: int = 1234,
    speaker_offset: int = 2000,
    progress: bool = True,
) -> dict:
    """Generate (or reuse) a VoxCeleb1 tree: ``wav/``, ``iden_split.txt``, ``veri_test.txt``.

    Speakers ``id10001...`` say sentences; within a speaker, videos differ by a prosody take.
    In ``iden_split.txt`` (every speaker, as in the real list) each speaker's last utterance of
    the first video is dev (2), the last of the second video test (3), the rest train (1). The
    last ``veri_speakers`` speakers form the verification test set: ``veri_test.txt`` lists
    ``trials_per_speaker`` target and as many non-target trials per speaker.

    Example
    -------
    >>> import tempfile
    >>> info = generate_voxceleb1(tempfile.mkdtemp() + "/vox", iden_speakers=2, veri_speakers=2,
    ...     videos_per_speaker=2, utterances_per_video=2, trials_per_speaker=1, progress=False)
    >>> info["summary"]["utterances"], info["summary"]["trials"]
    (16, 4)
    """
    options = {
        "corpus": "voxceleb1",
        "iden_speakers": int(iden_speakers),
        "veri_speakers": int(veri_speakers),
        "videos_per_speaker": int(videos_per_speaker),
        "utterances_per_video": int(utterances_per_video),
        "trials_per_speaker": int(trials_per_speaker),
        "seed": int(seed),
        "speaker_offset": int(speaker_offset),
    }
    if videos_per_speaker < 2 or utterances_per_video < 2:
        raise ValueError("videos_per_speaker and utterances_per_video must be >= 2")

    def build(tmp: str) -> dict:
        rng = np.random.default_rng([seed, 23])
        total = iden_speakers + veri_speakers
        voices = make_speakers(total, seed=seed, offset=speaker_offset)
        n_utts = total * videos_per_speaker * utterances_per_video
        texts = make_sentences("english", n_utts, seed=seed + 29)
        presets = ("neutral", "slow", "fast", "monotone")
        iden, by_speaker, cursor = [], {}, 0
        plan = []
        for s in range(total):
            spk = f"id{10001 + s}"
            for v in range(videos_per_speaker):
                video = "".join(rng.choice(list("abcdefghijkLMNOPQ0123456789_-"), 11))
                for u in range(utterances_per_video):
                    rel = f"{spk}/{video}/{u + 1:05d}.wav"
                    split = 1
                    if u == utterances_per_video - 1 and v == 0:
                        split = 2
                    elif u == utterances_per_video - 1 and v == 1:
                        split = 3
                    iden.append(f"{split} {rel}")
                    by_speaker.setdefault(spk, []).append(rel)
                    voice = apply_prosody(voices[s].voice("en"), presets[v % len(presets)])
                    plan.append((rel, _jitter(voice, rng), texts[cursor]))
                    cursor += 1
        for rel, voice, text in tqdm(
            plan, desc="espeak-ng VoxCeleb1", unit="utt", disable=not progress
        ):
            _write_wav(os.path.join(tmp, "wav", rel), synthesize(text, voice))
        with open(os.path.join(tmp, "iden_split.txt"), "w", encoding="utf-8") as handle:
            handle.write("\n".join(iden) + "\n")
        veri = sorted(by_speaker)[iden_speakers:]
        trials = []
        for spk in veri:
            utts = by_speaker[spk]
            others = [u for s in veri if s != spk for u in by_speaker[s]]
            for _ in range(trials_per_speaker):
                a, b = rng.choice(len(utts), 2, replace=False)
                trials.append(f"1 {utts[a]} {utts[b]}")
                trials.append(f"0 {utts[a]} {others[int(rng.integers(len(others)))]}")
        with open(os.path.join(tmp, "veri_test.txt"), "w", encoding="utf-8") as handle:
            handle.write("\n".join(trials) + "\n")
        return {"utterances": len(plan), "trials": len(trials), "veri_speakers": veri}

    return _cached(out_dir, options, build, name="VoxCeleb1")


def generate_iemocap(
    out_dir: str,
    *,
    sessions: int = 5,
    utterances_per_emotion: int = 4,
    emotions: tuple[str, ...] = ("neu", "hap", "exc", "sad", "ang", "fru"),
    seed: int = 1234,
    speaker_offset: int = 3000,
    progress: bool = True,
) -> dict:
    """Generate (or reuse) an IEMOCAP tree (``Session<n>/sentences/wav``, ``EmoEvaluation``).

    Each session has one female and one male speaker and one improvised dialog per speaker
    (``Ses0<n>F_impro01``, ``Ses0<n>M_impro01``); each speaker says ``utterances_per_emotion``
    sentences in every emotion, the emotion rendered by a prosody preset
    (:data:`EMOTION_PROSODY`).

    Example
    -------
    >>> import tempfile
    >>> info = generate_iemocap(tempfile.mkdtemp() + "/iemocap", sessions=1,
    ...     utterances_per_emotion=1, emotions=("neu", "sad"), progress=False)
    >>> info["summary"]
    {'Session1': 4}
    """
    unknown = [e for e in emotions if e not in EMOTION_PROSODY]
    if unknown:
        raise ValueError(
            f"emotions {unknown} have no prosody preset; known {sorted(EMOTION_PROSODY)}"
        )
    options = {
        "corpus": "iemocap",
        "sessions": int(sessions),
        "utterances_per_emotion": int(utterances_per_emotion),
        "emotions": list(emotions),
        "seed": int(seed),
        "speaker_offset": int(speaker_offset),
    }

    def build(tmp: str) -> dict:
        rng = np.random.default_rng([seed, 37])
        speakers = []
        for s in range(sessions):
            speakers += [
                make_speakers(1, seed=seed + s, gender="female", offset=speaker_offset)[0],
                make_speakers(1, seed=seed + s, gender="male", offset=speaker_offset)[0],
            ]
        per_speaker = utterances_per_emotion * len(emotions)
        texts = make_sentences("english", len(speakers) * per_speaker, seed=seed + 41)
        summary, plan, cursor = {}, [], 0
        evaluations: dict[str, list[str]] = {}
        for s in range(sessions):
            session = f"Session{s + 1}"
            summary[session] = 0
            for g, gender in enumerate("FM"):
                dialog = f"Ses{s + 1:02d}{gender}_impro01"
                order = [e for e in emotions for _ in range(utterances_per_emotion)]
                rng.shuffle(order)
                t = 0.0
                for u, emotion in enumerate(order):
                    utt = f"{dialog}_{gender}{u:03d}"
                    voice = apply_prosody(speakers[2 * s + g].voice("en"), EMOTION_PROSODY[emotion])
                    plan.append((session, dialog, utt, _jitter(voice, rng, 0.04), texts[cursor]))
                    cursor += 1
                    evaluations.setdefault(f"{session}/{dialog}", []).append(
                        f"[{t:.4f} - {t + 2.0:.4f}]\t{utt}\t{emotion}\t[2.5000, 2.5000, 2.5000]"
                    )
                    t += 2.5
                    summary[session] += 1
        for session, dialog, utt, voice, text in tqdm(
            plan, desc="espeak-ng IEMOCAP", unit="utt", disable=not progress
        ):
            _write_wav(
                os.path.join(tmp, session, "sentences", "wav", dialog, f"{utt}.wav"),
                synthesize(text, voice),
            )
        for key, lines in evaluations.items():
            session, dialog = key.split("/")
            path = os.path.join(tmp, session, "dialog", "EmoEvaluation", f"{dialog}.txt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("% [START_TIME - END_TIME] TURN_NAME EMOTION [V, A, D]\n\n")
                handle.write("\n\n".join(lines) + "\n")
        return summary

    return _cached(out_dir, options, build, name="IEMOCAP")

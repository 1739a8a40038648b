#!/usr/bin/env python3
"""Transcribe wav files with the model a federated MLS run trained.

``train_fl.py`` writes the final global model to ``<output_folder>/final_model`` (LoRA adapters
in peft's layout, connector and CTC head, the build options and, for the embedded tiny model, a
copy of the seed model; see :mod:`speechbrain_fl.models.checkpoint`). This script rebuilds the
model from that folder and decodes each file greedily (or with ``--num_beams``). Audio at
another sample rate is resampled to the model's 16 kHz.

To transcribe (the prompt of the MLS recipe names the language, so give it):

    > python recipes/MLS/transcribe.py results/MLS/tiny/alpha_split/freeze_encoder_False/1234/final_model \\
          speech.wav --language english

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import soundfile
import torch
import torchaudio.functional
from speechbrain.dataio.dataio import read_audio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mls_prepare import MLS_LANGUAGES  # noqa: E402

from speechbrain_fl.models.checkpoint import (  # noqa: E402
    CHECKPOINT_FILE,
    load_federated_model,
)

SAMPLE_RATE = 16000


def load_wav(path: str) -> torch.Tensor:
    """Mono float waveform at 16 kHz (SpeechBrain's ``read_audio``, resampled if needed)."""
    rate = soundfile.info(path).samplerate
    signal = read_audio(path)
    if signal.dim() > 1:  # (time, channels) -> mono
        signal = signal.mean(dim=-1)
    if rate != SAMPLE_RATE:
        signal = torchaudio.functional.resample(signal, rate, SAMPLE_RATE)
    return signal


def transcribe(model, wavs: list[str], *, language=None, num_beams=1, max_new_tokens=None):
    """Transcripts of ``wavs`` (one batch, padded), in order."""
    signals = [load_wav(w) for w in wavs]
    longest = max(len(s) for s in signals)
    batch = torch.zeros(len(signals), longest)
    for i, s in enumerate(signals):
        batch[i, : len(s)] = s
    lens = torch.tensor([len(s) / longest for s in signals])
    device = next(model.parameters()).device
    return model.transcribe(
        batch.to(device),
        lens.to(device),
        num_beams=num_beams,
        max_new_tokens=max_new_tokens,
        languages=[language] * len(wavs) if language else None,
    )


def check_wavs(wavs: list[str]) -> list[str]:
    """The problems of ``wavs`` before any model is built: a missing or unreadable file, named.

    Example
    -------
    >>> check_wavs(["/no/such.wav"])
    ['/no/such.wav: no such file']
    """
    problems = []
    for wav in wavs:
        if not os.path.isfile(wav):
            problems.append(f"{wav}: no such file")
            continue
        try:
            soundfile.info(wav)
        except (RuntimeError, soundfile.LibsndfileError) as err:  # not audio soundfile reads
            problems.append(f"{wav}: not a readable audio file ({err})")
    return problems


def language_needed(checkpoint: str, prompt: str) -> str:
    """The usage error of a run without ``--language`` whose prompt names ``{language}``.

    It lists the languages the model was trained on (``info.languages`` of the checkpoint's
    ``federated_model.json``, written by ``train_fl.py``), or every MLS language when the
    checkpoint does not record them.

    Example
    -------
    >>> "--language" in language_needed("/no/such/final_model", "transcribe {language}")
    True
    """
    path = Path(checkpoint) / CHECKPOINT_FILE
    try:
        trained = json.loads(path.read_text())["info"]["languages"]
    except (OSError, ValueError, KeyError, TypeError):
        trained = None
    listed = ", ".join(trained or MLS_LANGUAGES)
    which = "it was trained on" if trained else "one of the MLS languages"
    return (
        f"the model's prompt {prompt!r} names the audio's language: give --language "
        f"({which}: {listed})"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="final_model folder written by train_fl.py")
    parser.add_argument("wavs", nargs="+", help="audio files")
    parser.add_argument(
        "--language",
        default=None,
        choices=MLS_LANGUAGES,
        help="the MLS language of the audio (fills the prompt's {language})",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num_beams", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=None)
    args = parser.parse_args(argv)
    problems = check_wavs(args.wavs)
    if problems:
        parser.error("; ".join(problems))
    if not os.path.isdir(args.checkpoint):
        parser.error(f"{args.checkpoint}: no such folder (a train_fl.py run's final_model)")
    model = load_federated_model(args.checkpoint, device=args.device)
    if args.language is None and "{language}" in model.prompt:
        parser.error(language_needed(args.checkpoint, model.prompt))
    texts = transcribe(
        model,
        args.wavs,
        language=args.language,
        num_beams=args.num_beams,
        max_new_tokens=args.max_new_tokens,
    )
    for wav, text in zip(args.wavs, texts, strict=True):
        print(f"{wav}\t{text}")
    return texts


if __name__ == "__main__":
    main(sys.argv[1:])

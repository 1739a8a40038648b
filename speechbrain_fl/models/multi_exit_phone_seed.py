"""A tiny wav2vec 2.0 seed with its loss at the top: frame-level phone classification.

The paper starts from wav2vec 2.0 Base fine-tuned for ASR (wav2vec2-base-100h), whose upper
layers carry phonetic content that the lower ones lack. This module builds the tiny model's
analogue on generated public speech:

1. **Speech with phone timings.** Sentences of :func:`speechbrain_fl.data.sentences
   .make_sentences` spoken by voices of :func:`speechbrain_fl.data.voices.make_speakers`
   (from ``offset`` on, apart from the task corpora's), synthesised by
   :func:`speechbrain_fl.data.espeak.synthesize_phonemes`; frame t (20 ms, the model's frame
   rate) is labelled with the phoneme sounding over it (:func:`frame_labels`), ``_`` before the
   first and after the last. Stress and length marks are dropped (``'a`` and ``a`` are one
   label).
2. **Pretraining** (:func:`pretrain_phone_seed`). The random tiny model with one frame-level
   linear head after layer 12, trained by the frame cross-entropy over valid frames
   (``loss = -1/|F| sum_{t in F} log p_12(y_t | x)``; no CTC, so no all-blank phase), AdamW
   with a one-cycle lr (peak ``lr``, 10% warm-up), gradients clipped to norm 5.

Written by hand because no library labels espeak-ng speech per frame; the training loop is the
plain PyTorch one of :mod:`speechbrain_fl.models.pretrain`'s objectives.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = [
    "FRAME_S",
    "SILENCE",
    "frame_labels",
    "frame_loss",
    "build_phone_seed",
    "materialise_seed",
    "phone_corpus",
    "phone_seed_folder",
    "phone_seed_settings",
    "phone_set",
    "pretrain_phone_seed",
    "seed_tensors",
]

FRAME_S = 0.02  # the wav2vec 2.0 frame hop (320 samples at 16 kHz)
SILENCE = "_"
_MARKS = "',%="  # espeak-ng's stress and length marks, dropped from the labels


def frame_labels(phonemes, *, seconds, frames, hop=FRAME_S):
    """The phone label of each of ``frames`` frames of ``hop`` seconds.

    Phoneme k (``(name, start)`` in seconds) covers frames ``floor(start_k / hop)`` to
    ``ceil(end_k / hop) - 1``, where ``end_k`` is the next phoneme's start (``seconds``, the
    clip's length, for the last); a later phoneme overwrites a shared frame. Frames no
    phoneme covers are ``_``; marks ``',%=`` are stripped and empty names skipped.

    Example
    -------
    >>> frame_labels([("h", 0.0), ("'a", 0.05)], seconds=0.1, frames=6)
    ['h', 'h', 'a', 'a', 'a', '_']
    """
    labels = [SILENCE] * frames
    starts = [(name.lstrip(_MARKS), start) for name, start in phonemes]
    starts = [(name, start) for name, start in starts if name]
    for k, (name, start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else seconds
        for t in range(int(start / hop), min(frames, int(np.ceil(end / hop)))):
            labels[t] = name
    return labels


def phone_corpus(speakers, utterances, *, seed, offset, sample_rate=16000):
    """``[(speaker, wav, labels)]``: ``speakers`` voices x ``utterances`` sentences each.

    Utterance u of every voice is synthesised with espeak-ng seed u; ``labels`` has one entry
    per whole 20-ms frame of ``wav`` (:func:`frame_labels`).
    """
    from speechbrain_fl.data.espeak import synthesize_phonemes
    from speechbrain_fl.data.sentences import make_sentences
    from speechbrain_fl.data.voices import make_speakers

    voices = make_speakers(speakers, seed=seed, offset=offset)
    texts = make_sentences("english", speakers * utterances, seed=seed + 17 + offset)
    corpus = []
    for s, voice in enumerate(voices):
        for u in range(utterances):
            wav, phonemes = synthesize_phonemes(
                texts[s * utterances + u], voice.voice("en"), seed=u, sample_rate=sample_rate
            )
            seconds = len(wav) / sample_rate
            frames = int(seconds / FRAME_S)
            corpus.append((s, wav, frame_labels(phonemes, seconds=seconds, frames=frames)))
    return corpus


def phone_set(corpus):
    """The label inventory: ``_`` first, then the corpus's phones sorted."""
    return [SILENCE] + sorted({p for _, _, labels in corpus for p in labels} - {SILENCE})


def _batch(items, index):
    """Padded waveforms, relative lengths and frame labels (-100 beyond each utterance)."""
    wavs = [torch.from_numpy(w) for _, w, _ in items]
    longest = max(len(w) for w in wavs)
    batch = torch.zeros(len(wavs), longest)
    for i, w in enumerate(wavs):
        batch[i, : len(w)] = w
    lens = torch.tensor([len(w) / longest for w in wavs])
    labels = torch.full((len(items), int(longest / 16000 / FRAME_S) + 2), -100, dtype=torch.long)
    for i, (_, _, lab) in enumerate(items):
        labels[i, : len(lab)] = torch.tensor([index.get(p, 0) for p in lab])
    return batch, lens, labels


def frame_loss(model, wavs, lens, labels):
    """Mean cross-entropy of the frame labels at layer 12 over valid frames (label != -100).

    ``model`` is a :class:`~speechbrain_fl.models.multi_exit_wav2vec2.MultiExitWav2Vec2` with
    a ``ctc`` head at exit 12 (frame log-probabilities; no blank is used).
    """
    logp = model(wavs, lens, depth=12)  # (B, T, P) log-probabilities
    target = labels[:, : logp.shape[1]]
    if target.shape[1] < logp.shape[1]:
        pad = torch.full((target.shape[0], logp.shape[1] - target.shape[1]), -100)
        target = torch.cat([target, pad], dim=1)
    return torch.nn.functional.nll_loss(logp.transpose(1, 2), target, ignore_index=-100)


def pretrain_phone_seed(corpus, phones, *, steps, batch_size, lr, seed, cache_dir, log=print):
    """Pretrain the random tiny model's frame head at layer 12 on ``corpus``.

    Each step draws ``batch_size`` utterances without replacement (NumPy generator seeded
    with ``seed``); AdamW, ``OneCycleLR`` (peak ``lr``, 10% warm-up), clip norm 5. The global
    NumPy generator, which transformers' time masking draws from, is seeded with ``seed`` for
    the loop and restored after it, so the weights depend on the arguments only.

    Returns
    -------
    tuple
        ``(model, losses)``: the :class:`MultiExitWav2Vec2` (its ``backbone`` is the seed)
        and the loss of every step.
    """
    from transformers import Wav2Vec2Model

    from speechbrain_fl.models.multi_exit_wav2vec2 import MultiExitWav2Vec2, resolve_backbone

    torch.manual_seed(seed)
    source = resolve_backbone("tiny", cache_dir=cache_dir, seed=seed)
    model = MultiExitWav2Vec2(
        Wav2Vec2Model.from_pretrained(source), num_outputs=len(phones), exits=(12,), head="ctc"
    )
    model.train()
    index = {p: i for i, p in enumerate(phones)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=steps, pct_start=0.1
    )
    rng = np.random.default_rng(seed)
    losses = []
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        _train(model, corpus, index, optimizer, scheduler, rng, steps, batch_size, losses, log)
    finally:
        np.random.set_state(saved)
    return model, losses


def _train(model, corpus, index, optimizer, scheduler, rng, steps, batch_size, losses, log):
    """The steps of :func:`pretrain_phone_seed` (losses appended to ``losses``)."""
    for step in range(steps):
        size = min(batch_size, len(corpus))
        items = [corpus[i] for i in rng.choice(len(corpus), size, replace=False)]
        loss = frame_loss(model, *_batch(items, index))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"phone seed step {step}: loss {np.mean(losses[-50:]):.3f}")


def seed_tensors(folder):
    """The backbone tensors of a seed folder (``save_pretrained``'s ``model.safetensors``)."""
    from safetensors.torch import load_file

    return load_file(Path(folder) / "model.safetensors")


def materialise_seed(tensors, folder, *, cache_dir):
    """Write ``tensors`` as a ``Wav2Vec2Model`` folder of the tiny architecture.

    The architecture is the tiny preset's (:func:`speechbrain_fl.models.multi_exit_wav2vec2
    .resolve_backbone`); every tensor must match it (``strict=True``).
    """
    from transformers import Wav2Vec2Model

    from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone

    backbone = Wav2Vec2Model.from_pretrained(resolve_backbone("tiny", cache_dir=cache_dir))
    backbone.load_state_dict(tensors, strict=True)
    backbone.save_pretrained(folder)


def phone_seed_settings(*, speakers, utterances, speaker_offset, steps, batch_size, lr, seed):
    """Everything that shapes the phone seed's weights, as stored in a shipped seed's manifest.

    Example
    -------
    >>> s = phone_seed_settings(speakers=48, utterances=16, speaker_offset=900, steps=600,
    ...                         batch_size=8, lr=0.002, seed=1234)
    >>> s["objective"], s["model"], s["steps"]
    ('phones', 'tiny', 600)
    """
    from speechbrain_fl.models.multi_exit_wav2vec2 import tiny_config_tag

    return {
        "model": "tiny",
        "config_tag": tiny_config_tag(),
        "objective": "phones",
        "speakers": int(speakers),
        "utterances": int(utterances),
        "speaker_offset": int(speaker_offset),
        "steps": int(steps),
        "batch_size": int(batch_size),
        "lr": float(lr),
        "seed": int(seed),
    }


def build_phone_seed(folder, settings, *, cache_dir, log=print):
    """Generate the public phone corpus, pretrain, save the backbone into ``folder``.

    ``settings`` holds ``speakers``, ``utterances``, ``speaker_offset`` (the corpus),
    ``steps``, ``batch_size``, ``lr`` and ``seed`` (:func:`pretrain_phone_seed`). Writes
    ``pretraining.json`` beside the checkpoint (labels, first and last 50 losses' means).
    Returns ``(model, losses, phones)``.
    """
    import json

    corpus = phone_corpus(
        settings["speakers"], settings["utterances"], seed=settings["seed"],
        offset=settings["speaker_offset"],
    )  # fmt: skip
    phones = phone_set(corpus)
    model, losses = pretrain_phone_seed(
        corpus, phones, steps=settings["steps"], batch_size=settings["batch_size"],
        lr=settings["lr"], seed=settings["seed"], cache_dir=cache_dir, log=log,
    )  # fmt: skip
    folder = Path(folder)
    model.backbone.save_pretrained(folder)
    stats = {"phones": phones, "loss_first_50": float(np.mean(losses[:50])),
             "loss_last_50": float(np.mean(losses[-50:]))}  # fmt: skip
    (folder / "pretraining.json").write_text(json.dumps(stats, indent=1) + "\n")
    return model, losses, phones


def phone_seed_folder(settings, *, cache_folder, shipped=None, rebuild_hint=""):
    """The phone seed's checkpoint folder for ``settings``: shipped, cached or pretrained here.

    When ``shipped`` (a folder of :mod:`speechbrain_fl.recipe.shipped_seed`) was built with
    these ``settings`` its tensors are checked by SHA-256 and materialised in the cache;
    otherwise (one log line names the settings that differ) the seed is pretrained by
    :func:`build_phone_seed` and kept in the cache by
    :func:`speechbrain_fl.recipe.cached_seed_model`, keyed by ``settings``.

    Returns
    -------
    tuple
        ``(folder, timings)``: ``{"pretraining": seconds}`` when pretrained by this call.
    """
    import logging

    from speechbrain_fl.recipe import cached_seed_model
    from speechbrain_fl.recipe.shipped_seed import shipped_seed_folder, shipped_seed_serves

    if shipped is not None and shipped_seed_serves(shipped, settings):
        folder = shipped_seed_folder(
            shipped, settings=settings, cache_folder=cache_folder,
            prefix="seed_wav2vec2_tiny_phones_shipped", marker="config.json",
            materialise=lambda tensors, out: materialise_seed(tensors, out, cache_dir=cache_folder),
            rebuild_hint=rebuild_hint,
        )  # fmt: skip
        return folder, {}
    logger = logging.getLogger(__name__)
    return cached_seed_model(
        cache_folder=cache_folder,
        prefix="seed_wav2vec2_tiny_phones",
        key=dict(settings),
        build=lambda out: build_phone_seed(out, settings, cache_dir=cache_folder, log=logger.info),
        marker="config.json",
    )

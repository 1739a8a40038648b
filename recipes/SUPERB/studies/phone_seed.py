#!/usr/bin/env python3
"""A tiny seed with its loss at the top: frame-level phone classification, and layer probes.

The paper starts from wav2vec 2.0 Base fine-tuned for ASR, whose upper layers carry phonetic
content the lower ones lack. This study builds the tiny model's analogue and measures where it
keeps what:

1. **Public speech with phone timings.** ``--speakers`` x ``--utterances`` generated sentences
   (voices from ``--speaker_offset`` on, apart from the task corpora's), synthesised by
   espeak-ng with its phoneme events on; frame t (20 ms, the model's frame rate) is labelled
   with the phoneme sounding at its centre, ``_`` before the first and after the last.
   Stress marks are dropped (``'a`` and ``a`` are one label).
2. **Pretraining.** The random tiny model (12 layers, hidden 64) with one frame-level linear
   head after layer 12, trained by the cross-entropy of the frame labels over valid frames
   (``loss = -1/|F| sum_{t in F} log p_12(y_t | x)``), AdamW, one-cycle lr (peak ``--lr``),
   ``--steps`` steps of ``--batch_size`` utterances; the backbone is saved to
   ``<out>/seed`` (a folder ``train_fl.py --model`` loads).
3. **Probes** on frozen states of held-out voices (``--probe_speakers``), for the random
   model and the seed, after every layer l: *content*, a linear softmax probe of the frame's
   phone (trained on half of the voices, tested on the others: frame accuracy); *speaker*, a
   linear probe of the voice from the utterance's mean state (trained on the first
   utterances of each voice, tested on the rest). Probes are full-batch AdamW on standardised
   states, ``--probe_steps`` steps.

Writes ``<out>/phone_seed.json`` (losses, probe accuracies by layer, settings).

    > python recipes/SUPERB/studies/phone_seed.py --out /tmp/phone_seed

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

RECIPE_DIR = Path(__file__).resolve().parents[1]
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

FRAME_S = 0.02  # the wav2vec 2.0 frame hop (320 samples at 16 kHz)
_PHONEME_EVENTS = 0x0001  # espeakINITIALIZE_PHONEME_EVENTS
_EVENT_PHONEME = 7  # espeakEVENT_PHONEME
SILENCE = "_"


@contextmanager
def _phoneme_events(events):
    """espeak-ng with phoneme events on, its callback appending (phoneme, sample) to ``events``."""
    from speechbrain_fl.data import espeak

    def collect(wav, numsamples, evs):
        if wav and numsamples > 0:
            espeak._CHUNKS.append(np.ctypeslib.as_array(wav, shape=(numsamples,)).copy())
        i = 0
        while evs and evs[i].type != 0:  # espeakEVENT_LIST_TERMINATED
            if evs[i].type == _EVENT_PHONEME:
                name = ctypes.string_at(evs[i].id, 8).split(b"\0")[0].decode("ascii", "replace")
                events.append((name.lstrip("',%="), int(evs[i].sample)))  # stress marks dropped
            i += 1
        return 0

    saved = espeak._CALLBACK_REF, espeak._INITIALIZE_DONT_EXIT
    espeak._CALLBACK_REF = espeak._CALLBACK(collect)
    espeak._INITIALIZE_DONT_EXIT = saved[1] | _PHONEME_EVENTS
    try:
        yield
    finally:
        espeak._CALLBACK_REF, espeak._INITIALIZE_DONT_EXIT = saved


def synthesize_phones(text, voice, seed=0):
    """16 kHz float32 waveform of ``text`` and its phoneme label per 20-ms frame."""
    from speechbrain_fl.data import espeak

    events = []
    with _phoneme_events(events):
        pcm, rate = espeak._synth_pcm(text, voice, int(seed))
    wav = espeak.synthesize(text, voice, seed=seed)  # the same samples, resampled to 16 kHz
    seconds = len(pcm) / rate
    frames = int(len(wav) / 16000 / FRAME_S)
    labels = [SILENCE] * frames
    starts = [(name, sample / rate) for name, sample in events if name]
    for k, (name, start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else seconds
        first, last = int(start / FRAME_S), min(frames, int(np.ceil(end / FRAME_S)))
        for t in range(first, last):
            labels[t] = name
    return wav, labels


def build_corpus(speakers, utterances, *, seed, offset):
    """``[(speaker, wav, labels)]`` for ``speakers`` voices x ``utterances`` sentences."""
    from speechbrain_fl.data.sentences import make_sentences
    from speechbrain_fl.data.voices import make_speakers

    voices = make_speakers(speakers, seed=seed, offset=offset)
    texts = make_sentences("english", speakers * utterances, seed=seed + 17 + offset)
    corpus = []
    for s, voice in enumerate(voices):
        for u in range(utterances):
            wav, labels = synthesize_phones(texts[s * utterances + u], voice.voice("en"), seed=u)
            corpus.append((s, wav, labels))
    return corpus


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
    """Mean cross-entropy of the frame labels at layer 12 over valid frames."""
    logp = model(wavs, lens, depth=12)  # (B, T, P) log-probabilities
    target = labels[:, : logp.shape[1]]
    if target.shape[1] < logp.shape[1]:
        pad = torch.full((target.shape[0], logp.shape[1] - target.shape[1]), -100)
        target = torch.cat([target, pad], dim=1)
    return torch.nn.functional.nll_loss(logp.transpose(1, 2), target, ignore_index=-100)


def pretrain(corpus, phones, args):
    """Train the tiny model's frame head at layer 12; return (model, losses)."""
    from transformers import Wav2Vec2Model

    from speechbrain_fl.models.multi_exit_wav2vec2 import MultiExitWav2Vec2, resolve_backbone

    torch.manual_seed(args.seed)
    source = resolve_backbone("tiny", cache_dir=args.cache_folder, seed=args.seed)
    model = MultiExitWav2Vec2(
        Wav2Vec2Model.from_pretrained(source), num_outputs=len(phones), exits=(12,), head="ctc"
    )
    model.train()
    index = {p: i for i, p in enumerate(phones)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1
    )
    rng = np.random.default_rng(args.seed)
    losses = []
    for step in range(args.steps):
        size = min(args.batch_size, len(corpus))
        items = [corpus[i] for i in rng.choice(len(corpus), size, replace=False)]
        loss = frame_loss(model, *_batch(items, index))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {np.mean(losses[-50:]):.3f}", flush=True)
    return model, losses


@torch.no_grad()
def layer_states(model, corpus):
    """Per utterance: {layer: (T, H) state} for layers 1..12, trimmed to the frame labels."""
    model.eval()
    layers = tuple(range(1, 13))
    out = []
    for _, wav, labels in corpus:
        wavs = torch.from_numpy(wav).unsqueeze(0)
        _, _, captured = model.hidden(wavs, None, depth=12, capture=layers)
        n = min(len(labels), captured[12].shape[1])
        out.append({layer: captured[layer][0, :n] for layer in layers})
    return out


def linear_probe(x_train, y_train, x_test, y_test, classes, steps):
    """Test accuracy of a softmax-linear probe (standardised inputs, full-batch AdamW)."""
    torch.manual_seed(0)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-5
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    probe = torch.nn.Linear(x_train.shape[1], classes)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=0.05, weight_decay=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(probe(x_train), y_train).backward()
        optimizer.step()
    with torch.no_grad():
        return float((probe(x_test).argmax(-1) == y_test).float().mean())


def probes(model, corpus, phones, steps):
    """Content (frame phone) and speaker (utterance voice) probe accuracy per layer."""
    index = {p: i for i, p in enumerate(phones)}
    states = layer_states(model, corpus)
    speakers = sorted({s for s, _, _ in corpus})
    content_train = {s for s in speakers[: len(speakers) // 2]}
    first = {}
    for i, (s, _, _) in enumerate(corpus):
        first.setdefault(s, []).append(i)
    out = {"content": {}, "speaker": {}}
    for layer in range(1, 13):
        xs = {True: [], False: []}
        ys = {True: [], False: []}
        for (s, _, labels), st in zip(corpus, states, strict=True):
            frames = st[layer]
            xs[s in content_train].append(frames)
            ys[s in content_train].append(
                torch.tensor([index.get(p, 0) for p in labels[: len(frames)]])
            )
        out["content"][layer] = linear_probe(
            torch.cat(xs[True]), torch.cat(ys[True]), torch.cat(xs[False]), torch.cat(ys[False]),
            len(phones), steps,
        )  # fmt: skip
        pooled = torch.stack([st[layer].mean(0) for st in states])
        labels = torch.tensor([s for s, _, _ in corpus])
        train = torch.tensor([i not in first[s][-2:] for i, (s, _, _) in enumerate(corpus)])
        out["speaker"][layer] = linear_probe(
            pooled[train], labels[train], pooled[~train], labels[~train], len(speakers), steps
        )
        print(f"layer {layer}: content {out['content'][layer]:.3f} "
              f"speaker {out['speaker'][layer]:.3f}", flush=True)  # fmt: skip
    return out


def main(argv=None):
    """Build the corpus, pretrain, probe the random model and the seed, write the results."""
    from transformers import Wav2Vec2Model

    from speechbrain_fl.models.multi_exit_wav2vec2 import MultiExitWav2Vec2, resolve_backbone

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache_folder", default="results/SUPERB/cache")
    parser.add_argument("--speakers", type=int, default=48)
    parser.add_argument("--utterances", type=int, default=16)
    parser.add_argument("--speaker_offset", type=int, default=900)
    parser.add_argument("--probe_speakers", type=int, default=16)
    parser.add_argument("--probe_utterances", type=int, default=6)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--probe_steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    offset = args.speaker_offset
    corpus = build_corpus(args.speakers, args.utterances, seed=args.seed, offset=offset)
    probe_corpus = build_corpus(
        args.probe_speakers, args.probe_utterances, seed=args.seed,
        offset=args.speaker_offset + args.speakers,
    )  # fmt: skip
    phones = [SILENCE] + sorted({p for _, _, lab in corpus for p in lab} - {SILENCE})
    print(f"{len(corpus)} utterances, {len(phones)} phone labels", flush=True)
    model, losses = pretrain(corpus, phones, args)
    model.backbone.save_pretrained(out / "seed")
    random_model = MultiExitWav2Vec2(
        Wav2Vec2Model.from_pretrained(
            resolve_backbone("tiny", cache_dir=args.cache_folder, seed=args.seed)
        ),
        num_outputs=len(phones), exits=(12,), head="ctc",
    )  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "cache_folder")}
    results = {"settings": settings, "phones": phones, "loss_first_50": np.mean(losses[:50]),
               "loss_last_50": np.mean(losses[-50:]), "probes": {}}  # fmt: skip
    for name, net in (("random", random_model), ("phone_seed", model)):
        print(name, flush=True)
        results["probes"][name] = probes(net, probe_corpus, phones, args.probe_steps)
    (out / "phone_seed.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    return results


if __name__ == "__main__":
    main()

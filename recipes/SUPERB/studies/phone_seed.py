"""The phone seed and where it keeps what: per-layer linear probes of content and speaker.

The seed (:mod:`speechbrain_fl.models.multi_exit_phone_seed`) is the tiny model pretrained by
frame-level phone classification at layer 12 on generated public speech (``--speakers`` x
``--utterances`` sentences, voices from ``--speaker_offset`` on). This script pretrains it,
saves the backbone to ``<out>/seed`` (a folder ``train_fl.py --model`` loads) and, with
``--ship FOLDER``, writes it as the recipe's shipped seed (``seed.safetensors`` in float16 and
``seed.json`` with its SHA-256 and settings, :func:`speechbrain_fl.recipe.shipped_seed
.write_shipped_seed`). Then it probes the random model and the seed on frozen states of
held-out voices (``--probe_speakers`` x ``--probe_utterances``), after every layer l:
*content*, a linear softmax probe of the frame's phone (trained on half of the voices, tested
on the others: frame accuracy); *speaker*, a linear probe of the voice from the utterance's
mean state (trained on the first utterances of each voice, tested on the last two). Probes are
full-batch AdamW on standardised states, ``--probe_steps`` steps.

Writes ``<out>/phone_seed.json`` (losses, probe accuracies by layer, settings).

    > python recipes/SUPERB/studies/phone_seed.py --out /tmp/phone_seed --ship recipes/SUPERB/seed

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from speechbrain_fl.models.multi_exit_phone_seed import (
    build_phone_seed,
    phone_corpus,
    phone_seed_settings,
    seed_tensors,
)


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
    """Pretrain the seed (and ship it), probe the random model and the seed, write the results."""
    from transformers import Wav2Vec2Model

    from speechbrain_fl.models.multi_exit_wav2vec2 import MultiExitWav2Vec2, resolve_backbone
    from speechbrain_fl.recipe.shipped_seed import write_shipped_seed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ship", default=None, help="write the shipped seed into this folder")
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
    seed_keys = ("speakers", "utterances", "speaker_offset", "steps", "batch_size", "lr", "seed")
    seed_settings = phone_seed_settings(**{k: getattr(args, k) for k in seed_keys})
    model, losses, phones = build_phone_seed(
        out / "seed", seed_settings, cache_dir=args.cache_folder,
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    if args.ship:
        stats = json.loads((out / "seed" / "pretraining.json").read_text())
        command = "python recipes/SUPERB/studies/phone_seed.py --out OUT --ship " + args.ship
        manifest = write_shipped_seed(
            args.ship, seed_tensors(out / "seed"), settings=seed_settings,
            facts={"command": command, **stats},
        )  # fmt: skip
        print(f"Shipped seed written to {args.ship} (sha256 {manifest['sha256']})", flush=True)
    probe_corpus = phone_corpus(
        args.probe_speakers, args.probe_utterances, seed=args.seed,
        offset=args.speaker_offset + args.speakers,
    )  # fmt: skip
    random_model = MultiExitWav2Vec2(
        Wav2Vec2Model.from_pretrained(
            resolve_backbone("tiny", cache_dir=args.cache_folder, seed=args.seed)
        ),
        num_outputs=len(phones), exits=(12,), head="ctc",
    )  # fmt: skip
    excluded = ("out", "ship", "cache_folder")
    settings = {k: v for k, v in vars(args).items() if k not in excluded}
    results = {"settings": settings, "phones": phones, "loss_first_50": np.mean(losses[:50]),
               "loss_last_50": np.mean(losses[-50:]), "probes": {}}  # fmt: skip
    for name, net in (("random", random_model), ("phone_seed", model)):
        print(name, flush=True)
        results["probes"][name] = probes(net, probe_corpus, phones, args.probe_steps)
    (out / "phone_seed.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    return results


if __name__ == "__main__":
    main()

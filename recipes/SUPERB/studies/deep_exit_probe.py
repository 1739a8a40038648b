#!/usr/bin/env python3
"""Why a deep exit of the tiny model does not learn from random init: a short centralized probe.

Trains one exit of the recipe's multi-exit model on the pooled training clients of a task (the
KWS-12 default unless told otherwise) for a few hundred optimiser steps, in a plain loop with
the recipe's own model, data pipeline, optimiser groups and lr schedule
(:class:`~speechbrain_fl.models.multi_exit_optim.WarmupCosine`: linear warmup, cosine to 5% of
the peak), and records per window of steps:

- the training loss and accuracy at the exit;
- the gradient norm of every Transformer layer before clipping,
  ``||g_l||_2 = sqrt(sum_{p in layer l} ||dL/dp||_F^2)``, of the layers below the Transformer
  (``below``) and of the exit head: a post-LN stack whose lower layers get a vanishing share
  of the gradient is the failure Xiong et al. (2020, "On Layer Normalization in the
  Transformer Architecture") describe for post-LN without warmup;
- the mean cosine similarity of two frames of one utterance at the exit,
  ``mean_{t != s} <h_t, h_s> / (|h_t| |h_s|)`` over valid frames: near 1, the frames have
  collapsed to one direction and the statistical pooling's standard deviation carries nothing
  (rank collapse of deep attention stacks, Dong et al., 2021).

Then the validation accuracy at that exit. Variants: the peak ``--lr``, ``--warmup_fraction``
and ``--pre_ln`` (the tiny preset with ``do_stable_layer_norm``: pre-LN layers, every exit read
through the encoder's final LayerNorm). One JSON per probe in ``--output``.

    > python recipes/SUPERB/studies/deep_exit_probe.py --exit 12 --steps 300 --lr 2e-3 \\
          --output results/SUPERB/probes --cache_folder results/SUPERB/cache

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

RECIPE_DIR = Path(__file__).resolve().parents[1]  # recipes/SUPERB
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

from speechbrain_fl.models.multi_exit_optim import WarmupCosine, build_optimizer  # noqa: E402
from speechbrain_fl.models.multi_exit_wav2vec2 import layer_of  # noqa: E402


def layer_grad_norms(model) -> dict[str, float]:
    """``{"below": ., "1": ., ..., "12": ., "head": .}``: L2 norm of each group's gradients.

    A group is the Transformer layer (:func:`layer_of`), every exit head together
    (``head``) or everything below the Transformer (``below``); tensors without a gradient
    (layers past the trained depth) are left out, so their group is absent.
    """
    squares: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        kind, index = layer_of(name)
        key = str(index) if kind == "layer" else ("head" if kind == "exit" else "below")
        squares[key] = squares.get(key, 0.0) + float(param.grad.detach().pow(2).sum())
    return {k: math.sqrt(v) for k, v in squares.items()}


def frame_similarity(frames: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean cosine similarity of two distinct valid frames of one utterance, over the batch.

    Example
    -------
    >>> same = torch.ones(1, 4, 3)
    >>> round(frame_similarity(same, torch.ones(1, 4, dtype=torch.bool)), 6)
    1.0
    """
    values = []
    for state, valid in zip(frames.detach(), mask, strict=True):
        unit = torch.nn.functional.normalize(state[valid], dim=-1)
        n = unit.shape[0]
        if n < 2:
            continue
        gram = unit @ unit.T
        values.append(float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1))))
    return float(np.mean(values)) if values else float("nan")


def _settings(hparams_file, *, exit_, seed, cache_folder, output_folder):
    from superb_task import setup_run

    overrides = {
        "scenario": "centralized",
        "exit": exit_,
        "seed": seed,
        "cache_folder": cache_folder,
        "output_folder": output_folder,
        "measure_memory": False,
    }
    hparams, _, settings = setup_run(hparams_file, overrides)
    return hparams, settings


def _loaders(settings, batch_size, folder):
    import speechbrain as sb
    from superb_data import make_dataset
    from superb_task import _concat_csv

    pooled = os.path.join(folder, "probe_train.csv")
    _concat_csv(settings.clients, pooled)
    train = make_dataset(pooled, settings.data_folder, **settings.data_kw)
    valid = make_dataset(settings.valid_csv, settings.data_folder, **settings.data_kw)
    make = sb.dataio.dataloader.make_dataloader
    return (
        make(train, batch_size=batch_size, shuffle=True),
        make(valid, batch_size=batch_size, shuffle=False),
    )


def probe(
    settings,
    hparams,
    *,
    exit_,
    steps,
    lr,
    warmup_fraction,
    pre_ln,
    batch_size,
    window,
    seed,
    folder,
    schedule_steps=None,
    stream_seed=None,
):
    """Train exit ``exit_`` for ``steps`` steps; the per-window records and the valid accuracy.

    The lr schedule spans ``schedule_steps`` (default ``steps``): a longer span runs the first
    ``steps`` of a longer run's schedule (e.g. the 7 epochs of a centralized run).
    ``hparams`` gives the model factory, the optimiser class and ``max_grad_norm``.
    ``stream_seed`` reseeds torch's and numpy's generators once the model is built: the same
    initial weights and corpus, another draw of the batch order, the dropout masks and the
    SpecAugment time masks (transformers draws those from numpy's generator).
    """
    from superb_task import new_model

    options = dict(settings.model)
    overrides = dict(options.get("config_overrides") or {})
    overrides["do_stable_layer_norm"] = bool(pre_ln)
    torch.manual_seed(seed)
    model = new_model(
        {**options, "seed": seed, "config_overrides": overrides}, hparams["model_factory"]
    )
    optimizer = build_optimizer(model, opt_class=hparams["opt_class"], lr=lr)
    annealing = WarmupCosine(warmup_fraction=warmup_fraction, min_ratio=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: annealing(done + 1, schedule_steps or steps)
    )
    max_norm = float(hparams["max_grad_norm"])
    train, valid = _loaders(settings, batch_size, folder)
    if stream_seed is not None:
        torch.manual_seed(stream_seed)
        np.random.seed(stream_seed)
    records, acc = [], {"loss": [], "correct": 0, "seen": 0, "norms": [], "sim": []}
    step, start = 0, time.time()
    while step < steps:
        for batch in train:
            model.train()
            wavs, lens = batch.sig
            target = batch.label_id.data[:, 0]
            _, frame_mask, captured = model.hidden(wavs, lens, depth=exit_)
            logits = model.heads[str(exit_)](captured[exit_], frame_mask)
            loss = torch.nn.functional.cross_entropy(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            acc["norms"].append(layer_grad_norms(model))
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            schedule.step()
            acc["loss"].append(float(loss.detach()))
            acc["correct"] += int((logits.argmax(-1) == target).sum())
            acc["seen"] += len(target)
            acc["sim"].append(frame_similarity(captured[exit_], frame_mask))
            step += 1
            if step % window == 0 or step == steps:
                keys = acc["norms"][0].keys()
                records.append(
                    {
                        "step": step,
                        "lr": schedule.get_last_lr()[0],
                        "train_loss": float(np.mean(acc["loss"])),
                        "train_acc": acc["correct"] / max(1, acc["seen"]),
                        "frame_cosine": float(np.mean(acc["sim"])),
                        "grad_norm": {
                            k: float(np.mean([n[k] for n in acc["norms"]])) for k in keys
                        },
                    }
                )
                print(json.dumps(records[-1]), flush=True)
                acc = {"loss": [], "correct": 0, "seen": 0, "norms": [], "sim": []}
            if step >= steps:
                break
    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for batch in valid:
            wavs, lens = batch.sig
            target = batch.label_id.data[:, 0]
            correct += int((model(wavs, lens, depth=exit_).argmax(-1) == target).sum())
            seen += len(target)
    return {"records": records, "valid_acc": correct / seen, "wall_s": time.time() - start}


def main(argv=None):
    """Run one probe and write ``<output>/<name>.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hparams", default="hparams/kws.yaml")
    parser.add_argument("--exit", type=int, default=12)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup_fraction", type=float, default=0.1)
    parser.add_argument(
        "--schedule_steps", type=int, default=None, help="the lr schedule's span (default: steps)"
    )
    parser.add_argument("--pre_ln", action="store_true", help="do_stable_layer_norm (pre-LN)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--window", type=int, default=25, help="steps per record")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--stream_seed",
        type=int,
        default=None,
        help="reseed the batch order, dropout and time masks after the model is built",
    )
    parser.add_argument("--output", default="results/SUPERB/probes")
    parser.add_argument("--cache_folder", default="results/SUPERB/cache")
    parser.add_argument("--name", default=None, help="default: from the options")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    name = args.name or (
        f"exit{args.exit}_lr{args.lr:g}_wu{args.warmup_fraction:g}"
        f"{f'_of{args.schedule_steps}' if args.schedule_steps else ''}_n{args.steps}"
        f"{'_preln' if args.pre_ln else ''}_s{args.seed}"
        f"{f'_stream{args.stream_seed}' if args.stream_seed is not None else ''}"
    )
    out = Path(args.output)
    run_folder = out / "run" / f"s{args.seed}"
    hparams, settings = _settings(
        args.hparams,
        exit_=args.exit,
        seed=args.seed,
        cache_folder=args.cache_folder,
        output_folder=str(run_folder),
    )
    result = probe(
        settings,
        hparams,
        exit_=args.exit,
        steps=args.steps,
        lr=args.lr,
        warmup_fraction=args.warmup_fraction,
        pre_ln=args.pre_ln,
        batch_size=args.batch_size,
        window=args.window,
        seed=args.seed,
        folder=str(run_folder),
        schedule_steps=args.schedule_steps,
        stream_seed=args.stream_seed,
    )
    result["options"] = vars(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"{name}: valid acc {result['valid_acc']:.3f} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

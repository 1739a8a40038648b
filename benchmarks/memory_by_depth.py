#!/usr/bin/env python3
"""Peak training memory of the multi-exit wav2vec 2.0 per exit, against the paper's reductions.

For each task's batch shape (our choice: KWS 1 s, SID/ER/ASR 3 s utterances, batch 16/16/16/8)
and each exit in {3, 6, 9, 12}, one training step (forward to the exit, loss, backward, AdamW
step) is measured by :func:`speechbrain_fl.models.exit_memory.peak_training_memory`: CUDA
``max_memory_allocated`` when a GPU is there, else the peak RSS of a fresh subprocess per depth.
Both with the CNN feature encoder trained and frozen. Prints (and with ``--markdown`` writes) a
table with the 12 -> 3 reduction beside the paper's (KWS 43.27%, SID 24.51%, ER 15.48%,
ASR 9.59%, GPU memory of wav2vec 2.0 Base).

    > python benchmarks/memory_by_depth.py                      # tiny model, CPU RSS
    > python benchmarks/memory_by_depth.py --model wav2vec2-base-100h --device cuda
    > python benchmarks/memory_by_depth.py --tasks kws --exits 3 12 --markdown out.md

The table reads as a user would: the ``model`` figure of each cell is the peak less what the
process held before the model was built (``import_mb``: interpreter, torch, transformers,
~700 MB on CPU that no depth changes), i.e. weights + activations + gradients + AdamW state,
the quantity CUDA's ``max_memory_allocated`` reports on a GPU; the reduction is taken on it.
LayerDrop is off (``Wav2Vec2Config``'s default 0.1 would skip layers at random). Input
lengths: ``--manifests kws=train.csv ...`` measures each task at the 95th percentile of its
manifests' durations (:func:`~speechbrain_fl.models.exit_memory.manifest_seconds`) instead
of the fixed lengths above.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speechbrain_fl.models.exit_memory import manifest_seconds, peak_training_memory  # noqa: E402
from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone  # noqa: E402

PAPER_REDUCTION = {"kws": 43.27, "sid": 24.51, "er": 15.48, "asr": 9.59}
#: (seconds per utterance, batch size, head, outputs) per task (ours)
SHAPES = {
    "kws": (1.0, 16, "utterance", 12),
    "sid": (3.0, 16, "utterance", 1251),
    "er": (3.0, 16, "utterance", 4),
    "asr": (3.0, 8, "ctc", 29),
}


def main(argv=None):
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny | base-random (Base architecture, random weights: memory needs no download) "
        "| wav2vec2-base-100h | folder",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--exits", nargs="+", type=int, default=[3, 6, 9, 12])
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument(
        "--manifests",
        nargs="+",
        default=[],
        metavar="TASK=CSV",
        help="measure TASK at the p95 duration of CSV (repeat a task for several files)",
    )
    args = parser.parse_args(argv)
    lengths = {}
    for item in args.manifests:
        task, _, path = item.partition("=")
        if task not in SHAPES or not path:
            raise SystemExit(f"--manifests {item!r}: expected TASK=CSV with TASK in {list(SHAPES)}")
        lengths.setdefault(task, []).append(path)
    cache = args.cache_dir or tempfile.mkdtemp()
    if args.model == "base-random":
        source = str(Path(cache) / "wav2vec2_base_random")
        if not (Path(source) / "config.json").is_file():
            from transformers import Wav2Vec2Config, Wav2Vec2Model

            Wav2Vec2Model(Wav2Vec2Config()).save_pretrained(source)  # Base's default config
    else:
        source = resolve_backbone(args.model, cache_dir=cache)
    exits = sorted(args.exits)
    header = (
        "| Task | Feature encoder | "
        + " | ".join(f"exit {e} model MB (peak)" for e in exits)
        + f" | Reduction {exits[-1]}->{exits[0]}, model (peak) | Paper |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    kind = None
    for task in args.tasks:
        seconds, batch, head, outputs = SHAPES[task]
        if task in lengths:
            seconds = manifest_seconds(lengths[task], quantile=0.95)
        for frozen in (False, True):
            figures = {}
            for e in exits:
                m = peak_training_memory(
                    source,
                    depth=e,
                    batch_size=batch,
                    seconds=seconds,
                    head=head,
                    num_outputs=outputs,
                    freeze_feature_encoder=frozen,
                    device=args.device,
                    cache_dir=cache,
                )
                figures[e], kind = m, m["kind"]
                print(f"{task} frozen={frozen} exit {e}: {m}", flush=True)
            deep, shallow = figures[exits[-1]], figures[exits[0]]
            model_red = 100 * (1 - shallow["model_mb"] / deep["model_mb"])
            peak_red = 100 * (1 - shallow["peak_mb"] / deep["peak_mb"])
            lines.append(
                f"| {task.upper()} ({seconds:g} s x {batch}) | {'frozen' if frozen else 'trained'} | "
                + " | ".join(
                    f"{figures[e]['model_mb']:.0f} ({figures[e]['peak_mb']:.0f})" for e in exits
                )
                + f" | {model_red:.1f}% ({peak_red:.1f}%) | {PAPER_REDUCTION[task]:.2f}% |"
            )
    table = "\n".join(lines)
    note = (
        f"\nModel {args.model}; memory kind {kind} "
        "(cuda: max_memory_allocated; cpu_rss: peak RSS of a fresh process per depth, model = "
        "peak minus the RSS before the model was built); LayerDrop 0."
    )
    print("\n" + table + note)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n" + note + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

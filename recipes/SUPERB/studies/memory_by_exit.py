#!/usr/bin/env python3
"""Training memory of a client per exit for a task's batch shape, and what exit 3 saves.

For each exit, :func:`speechbrain_fl.models.exit_memory.training_memory` counts one training
step (forward to the exit, loss, backward, AdamW step) from its tensors: the weights the
forward to the exit uses, the gradients and the two AdamW moments of what trains, and the
activations autograd saves for backward (on CUDA the total is ``max_memory_allocated``).
The batch is the task file's ``batch_size`` clips of ``--seconds`` (or the 95th percentile of
``--manifests``' durations; else the task's nominal length), with its LayerDrop, SpecAugment
and feature-encoder settings. Prints a markdown table with the saving of the shallowest exit
against the deepest, ``100 (1 - total_shallow / total_deep)``, beside the paper's
(wav2vec 2.0 Base, exit 3 vs 12: KWS 43.27%, SID 24.51%, ER 15.48%, ASR 9.59%).

    > python recipes/SUPERB/studies/memory_by_exit.py hparams/kws.yaml                # tiny
    > python recipes/SUPERB/studies/memory_by_exit.py hparams/asr.yaml --model base-random \\
          --seconds 2.7514

``--model base-random`` is ``Wav2Vec2Config()``'s architecture (wav2vec 2.0 Base: 12 layers,
hidden 768) with random weights, written once to ``--cache_folder``: memory needs no download.

``--per_task FILE`` measures instead the paper's comparison, exit 3 against exit 12, for the
four tasks at their real corpora's input lengths (Speech Commands 1 s, VoxCeleb1 8 s, IEMOCAP
4.5 s, LibriSpeech 12 s; ``--batch_size`` clips each), with the CNN front-end frozen and
trained, under three measures of :func:`speechbrain_fl.models.step_memory.step_memory`: the
tensors of the step (weights used, gradients, AdamW moments, saved activations), the
allocator peak of a step (the largest sum of live tensor storages, transient buffers
included) and that peak for a client holding every layer's weights (``resident``). Each
saving is ``100 (1 - m_3 / m_12)``; the results go to ``FILE`` (JSON) with
the paper's four savings and whether each measure orders the tasks as the paper does
(KWS > SID > ER > ASR).

    > python recipes/SUPERB/studies/memory_by_exit.py --model base-random --batch_size 4 \\
          --per_task recipes/SUPERB/studies/memory_by_task.json

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parents[1]
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

PAPER_SAVING = {"kws12": 43.27, "kws35": 43.27, "sid": 24.51, "asv": 24.51, "er": 15.48,
                "asr": 9.59}  # fmt: skip
PARTS = ("total", "weights", "gradients", "optimizer", "activations")
MEASURES = ("saved", "peak", "resident")  # see speechbrain_fl.models.step_memory.step_memory
#: (task, hparams file, seconds of a typical clip of the real corpus, classes of its head:
#: KWS-12, VoxCeleb1's 1,251 identities, IEMOCAP's 4 emotions, 28 CTC characters + blank)
PAPER_TASKS = (
    ("kws12", "kws.yaml", 1.0, 12),
    ("sid", "sid.yaml", 8.0, 1251),
    ("er", "er.yaml", 4.5, 4),
    ("asr", "asr.yaml", 12.0, 29),
)


def resolve_model(model, cache_folder):
    """The folder ``build_multi_exit`` loads: a preset, a folder, or ``base-random``."""
    from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone

    if model != "base-random":
        return resolve_backbone(model, cache_dir=cache_folder)
    folder = Path(cache_folder) / "wav2vec2_base_random"
    if not (folder / "config.json").is_file():
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        Wav2Vec2Model(Wav2Vec2Config()).save_pretrained(folder)
    return str(folder)


def per_task(source, model_name, batch_size, path, cache_folder):
    """Exit 3 vs exit 12 for every task of the paper, two measures, frozen and trained CNN.

    Writes ``path`` (JSON): per task and front-end the MiB of each exit under each measure
    and the savings ``100 (1 - m_3 / m_12)``, the paper's saving, and per measure and
    front-end whether the savings fall as KWS > SID > ER > ASR.
    """
    import json

    from superb_data import TASKS
    from superb_settings import CONFIG_KEYS
    from superb_task import load_hparams

    from speechbrain_fl.models.step_memory import step_memory

    rows = []
    for task, file, seconds, classes in PAPER_TASKS:
        hparams, _, _ = load_hparams(RECIPE_DIR / "hparams" / file)
        for front_end in ("frozen", "trained"):
            exits = {}
            for depth in (3, 12):
                exits[depth] = step_memory(
                    source,
                    depth=depth,
                    batch_size=batch_size,
                    seconds=seconds,
                    head=TASKS[task]["head"],
                    num_outputs=classes,
                    freeze_feature_encoder=front_end == "frozen",
                    cache_dir=cache_folder,
                    config_overrides={k: hparams[k] for k in CONFIG_KEYS},
                )
                print(task, seconds, front_end, depth, exits[depth], flush=True)
            row = {"task": task, "seconds": seconds, "front_end": front_end, "classes": classes}
            row["paper_saving_pct"] = PAPER_SAVING[task]
            for measure in MEASURES:
                m3, m12 = exits[3][measure]["total"], exits[12][measure]["total"]
                row[measure] = {
                    "exit3_mib": round(m3, 1),
                    "exit12_mib": round(m12, 1),
                    "saving_pct": round(100 * (1 - m3 / m12), 2),
                    "exit3": exits[3][measure],
                    "exit12": exits[12][measure],
                }
            rows.append(row)
    order = {}
    for measure in MEASURES:
        for front in ("frozen", "trained"):
            savings = [r[measure]["saving_pct"] for r in rows if r["front_end"] == front]
            order[f"{measure}_{front}"] = all(
                a > b for a, b in zip(savings, savings[1:], strict=False)
            )
    out = {"model": model_name, "batch_size": batch_size, "rows": rows}
    out["paper_order_kws_sid_er_asr"] = order
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def main(argv=None):
    """Measure every exit and print the table."""
    from superb_data import CTC_ALPHABET, TASKS
    from superb_settings import CONFIG_KEYS
    from superb_task import load_hparams

    from speechbrain_fl.models.exit_memory import manifest_seconds, training_memory

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hparams", nargs="?", help="a task file, e.g. hparams/kws.yaml")
    parser.add_argument("--per_task", default=None, help="JSON file: exit 3 vs 12 per task")
    parser.add_argument("--batch_size", type=int, default=4, help="clips per step (--per_task)")
    parser.add_argument("--model", default="tiny", help="tiny | base-random | a folder")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--manifests", nargs="+", default=[])
    parser.add_argument("--num_outputs", type=int, default=12, help="utterance tasks' classes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache_folder", default="results/SUPERB/cache")
    args = parser.parse_args(argv)
    if args.per_task:
        source = resolve_model(args.model, args.cache_folder)
        return per_task(source, args.model, args.batch_size, args.per_task, args.cache_folder)
    if not args.hparams:
        parser.error("a task file (e.g. hparams/kws.yaml) or --per_task FILE is needed")
    path = Path(args.hparams)
    hparams, _, _ = load_hparams(path if path.is_file() else RECIPE_DIR / path)
    task = hparams["task"]
    spec = TASKS[task]
    seconds = args.seconds
    if seconds is None:
        seconds = manifest_seconds(args.manifests) if args.manifests else spec["seconds"]
    ctc = spec["head"] == "ctc"
    source = resolve_model(args.model, args.cache_folder)
    figures = {}
    for depth in hparams["exits"]:
        figures[depth] = training_memory(
            source,
            depth=depth,
            batch_size=hparams["batch_size"],
            seconds=seconds,
            head=spec["head"],
            num_outputs=len(CTC_ALPHABET) + 1 if ctc else args.num_outputs,
            freeze_feature_encoder=hparams["freeze_feature_encoder"],
            device=args.device,
            config_overrides={k: hparams[k] for k in CONFIG_KEYS},
        )
        print(f"exit {depth}: {figures[depth]}", flush=True)
    shallow, deep = min(figures), max(figures)
    saving = 100 * (1 - figures[shallow]["total"] / figures[deep]["total"])
    lines = [
        f"{task}, model {args.model}, batch {hparams['batch_size']} x {seconds:g} s, "
        f"method {figures[deep]['method']} (MiB)",
        "",
        "| Exit | " + " | ".join(PARTS) + " |",
        "|---" * (len(PARTS) + 1) + "|",
    ]
    lines += [
        f"| {d} | " + " | ".join(f"{m[k]:.1f}" for k in PARTS) + " |" for d, m in figures.items()
    ]
    lines.append(
        f"\nSaved at exit {shallow} vs exit {deep}: {saving:.1f}% "
        f"(paper, wav2vec 2.0 Base: {PAPER_SAVING[task]:.2f}%)"
    )
    print("\n".join(lines))
    return figures


if __name__ == "__main__":
    main()

"""Why a federated run's dev WER falls while its test WER barely moves: both models on every split.

Loads a ``recipes/MLS/train_fl.py`` run's ``final_model/`` and the seed model it started from
(the checkpoint's base with the same, untrained, adapters: B = 0 LoRA reproduces the seed),
decodes ``dev``, ``test`` and a sample of the clients' own ``train`` utterances with both, and
prints per split the seed and final WER and the paired speaker-level change (final - seed, 95%
CI), then the test change by speaker group: training speakers who read another book in test
(MLS's overlap) against unseen ones. Dev and test are decoded by the same code path, so a gap
between their changes is in the data (which speakers, how many) or in selection, not decoding.

Run (on the output folder of a finished run, with its cache)::

    python benchmarks/mls_dev_test_gap.py results/MLS/tiny/fedavg/freeze_encoder_False/1234 \\
        --manifests results/MLS/cache/manifests_<tag>
"""

import argparse
import csv
import json
import os
import random
import sys

import torch

from speechbrain_fl.metrics.utterances import paired_bootstrap_details
from speechbrain_fl.models.checkpoint import CHECKPOINT_FILE, load_federated_model
from speechbrain_fl.models.presets import build_speech_llm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from mls_domain_gap import evaluate  # noqa: E402


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="output_folder of a finished train_fl.py run")
    parser.add_argument("--manifests", required=True, help="the run's manifests folder")
    parser.add_argument("--corpus", required=True, help="the corpus root (data_folder)")
    parser.add_argument("--train-sample", type=int, default=144, help="train utterances decoded")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    torch.manual_seed(0)
    final_folder = os.path.join(args.run, "final_model")
    spec = json.load(open(os.path.join(final_folder, CHECKPOINT_FILE), encoding="utf-8"))
    base = spec["base"]
    if os.path.isdir(os.path.join(final_folder, base)):
        base = os.path.join(final_folder, base)
    seed = build_speech_llm(base, **spec["options"]).eval()
    final = load_federated_model(final_folder).eval()
    train = _rows(os.path.join(args.manifests, "train.csv"))
    random.Random(0).shuffle(train)
    sample = os.path.join(args.run, "gap_train_sample.csv")
    with open(sample, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(train[0]))
        writer.writeheader()
        writer.writerows(train[: args.train_sample])
    splits = {
        "dev": os.path.join(args.manifests, "dev.csv"),
        "test": os.path.join(args.manifests, "test.csv"),
        "train (clients' own)": sample,
    }
    out = {}
    details = {}
    for name, path in splits.items():
        a = evaluate(final, path, args.corpus, max_new_tokens=args.max_new_tokens)
        b = evaluate(seed, path, args.corpus, max_new_tokens=args.max_new_tokens)
        details[name] = (a, b)
        r = paired_bootstrap_details(a, b, num_resamples=args.resamples)
        out[name] = r.to_dict()
        print(
            f"{name:22} utts {r.num_utterances:4d} speakers {r.num_speakers:3d}  seed "
            f"{r.wer_b:.3f} -> final {r.wer_a:.3f}  change {r.difference:+.3f} "
            f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
        )
    train_speakers = {r["spk_id"] for r in train}
    a, b = details["test"]
    for group, keep in (
        ("test, training speakers", lambda s: s in train_speakers),
        ("test, unseen speakers", lambda s: s not in train_speakers),
    ):
        idx = [i for i, s in enumerate(a.speakers) if keep(s)]
        ids = {a.ids[i] for i in idx}
        jdx = [i for i, u in enumerate(b.ids) if u in ids]
        if not idx:
            continue
        r = paired_bootstrap_details(a.take(idx), b.take(jdx), num_resamples=args.resamples)
        out[group] = r.to_dict()
        print(
            f"{group:22} utts {r.num_utterances:4d} speakers {r.num_speakers:3d}  seed "
            f"{r.wer_b:.3f} -> final {r.wer_a:.3f}  change {r.difference:+.3f} "
            f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
        )
    with open(os.path.join(args.run, "dev_test_gap.json"), "w", encoding="utf-8") as handle:
        json.dump(out, handle, indent=2)


if __name__ == "__main__":
    main()

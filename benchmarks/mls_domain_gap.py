"""The domain gap of the embedded MLS corpus: the seed model on public-domain vs client speech.

The embedded corpus (``speechbrain_fl/data/mls_synth.py``) makes its public split (seed-model
pretraining) differ from the federated splits: client sentences use phrases the public split
never has, and client speakers use voice variants and speaking rates public speakers do not.
This script measures that gap for a pretrained tiny seed model, with speaker-level bootstrap
intervals (``speechbrain_fl/metrics/utterances.py``):

- LLM greedy WER on ``public_test`` (unseen speakers of the public domain: the seed model's
  own held-out domain) and on ``test`` (client domain, the recipe's test split);
- ``test`` broken down by text (utterances with / without a client-only word) and by voice
  (speakers with a client-only variant, or a rate outside the public window, / the others).

With ``--adapt-steps N`` it then trains the federated stage's trainable tensors (LoRA r=8 on
encoder and LLM, connector, CTC head; ``--adapt-part audio|encoder|llm`` a part of them; every
parameter with ``--adapt-whole-model``) centrally
for N AdamW steps on the pooled ``train`` split (``--adapt-on``: or its utterances without a
client-only word, or the public split as a control) and evaluates ``test`` and ``public_test``
again: what the clients' data can teach when pooled, the ceiling a federated run approaches.

With ``--run <output_folder of recipes/MLS/train_fl.py>`` it also reads that run's
``test_utterances_round0.csv`` and ``test_utterances.csv`` and prints the paired change from
round 0 on each of those subsets: which part of the gap federated training closed.

Run (the corpus and seed model of a recipe run with ``--cache_folder /tmp/c``)::

    python benchmarks/mls_domain_gap.py --corpus /tmp/c/mls_synth --seed-model /tmp/c/seed_tiny_<tag>
    python benchmarks/mls_domain_gap.py --corpus /tmp/c/mls_synth --run results/MLS/tiny/fedavg/...
"""

import argparse
import csv
import json
import logging
import os
import sys

import numpy as np
import speechbrain as sb
import torch

from speechbrain_fl.data.mls_synth import CLIENT_ONLY_VARIANTS, PUBLIC_RATE
from speechbrain_fl.data.sentences import novel_words
from speechbrain_fl.metrics.utterances import (
    bootstrap_details,
    paired_bootstrap_details,
    read_utterance_details,
    utterance_errors_from_stats,
)
from speechbrain_fl.models.presets import build_speech_llm
from speechbrain_fl.models.pretrain import pretrain_seed_model

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "MLS")
sys.path.insert(0, RECIPE)
from mls_prepare import prepare_mls  # noqa: E402
from mls_seed_model import _Batches  # noqa: E402
from train_fl import make_dataset  # noqa: E402


def speaker_voices(corpus: str) -> dict[str, dict]:
    """Speaker id -> {"variant", "rate"} from each language's metainfo.txt CHAPTER column."""
    out = {}
    for name in sorted(os.listdir(corpus)):
        path = os.path.join(corpus, name, "metainfo.txt")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as handle:
            next(handle)
            for line in handle:
                fields = [f.strip() for f in line.split("|")]
                _, variant, _, rate = fields[6].split()  # "espeak-ng <variant> p<pitch> r<rate>"
                out[fields[0]] = {"variant": variant, "rate": int(rate[1:])}
    return out


def subsets(rows: list[dict], voices: dict) -> dict[str, np.ndarray]:
    """Boolean masks over manifest rows: novel text, client-only voice, and their complements."""
    novel = {lang: novel_words(lang) for lang in {r["language"] for r in rows}}
    text = np.array([bool(set(r["wrd"].split()) & novel[r["language"]]) for r in rows])

    def client_voice(spk):
        v = voices[spk]
        return v["variant"] in CLIENT_ONLY_VARIANTS or not (
            PUBLIC_RATE[0] <= v["rate"] <= PUBLIC_RATE[1]
        )

    voice = np.array([client_voice(r["spk_id"]) for r in rows])
    return {
        "client-only words": text,
        "public words only": ~text,
        "client-only voice": voice,
        "public voice": ~voice,
    }


def evaluate(model, csv_path, corpus, *, max_new_tokens):
    """Per-utterance LLM greedy errors on a manifest (UtteranceErrors)."""
    loader = sb.dataio.dataloader.make_dataloader(
        make_dataset(csv_path, corpus), batch_size=32, shuffle=False
    )
    stats = sb.utils.metric_stats.ErrorRateStats()
    with torch.no_grad():
        for batch in loader:
            wavs, lens = batch.sig
            hyps = model.transcribe(
                wavs, lens, max_new_tokens=max_new_tokens, languages=list(batch.language)
            )
            stats.append(batch.id, [h.split() for h in hyps], [t.split() for t in batch.wrd])
    rows = _rows(csv_path)
    return utterance_errors_from_stats(
        stats,
        speaker_of={r["ID"]: r["spk_id"] for r in rows},
        language_of={r["ID"]: r["language"] for r in rows},
    )


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _fmt(interval) -> str:
    return f"{interval.wer:.3f} [{interval.ci_low:.3f}, {interval.ci_high:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="embedded corpus root (mls_synth)")
    parser.add_argument("--seed-model", help="seed_tiny_<tag> folder of the recipe's cache")
    parser.add_argument("--run", help="output_folder of a recipes/MLS/train_fl.py run")
    parser.add_argument("--manifests", help="where to write manifests (default: <corpus>_gap)")
    parser.add_argument("--prompt", default="transcribe {language}")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--adapt-steps", type=int, default=0)
    parser.add_argument("--adapt-lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--adapt-on",
        choices=("train", "train_public_words", "public"),
        default="train",
        help="pooled client train split, its utterances without client-only words, or the "
        "public split (control)",
    )
    parser.add_argument(
        "--adapt-part",
        choices=("all", "audio", "encoder", "llm"),
        default="all",
        help="which of the federated set trains: all (LoRA on encoder and LLM, connector, CTC "
        "head), audio (all but the LLM's LoRA: train_llm_lora False), encoder (encoder LoRA + "
        "CTC head) or llm (the LLM's LoRA only)",
    )
    parser.add_argument(
        "--adapt-input-noise",
        type=float,
        default=0.0,
        help="share of teacher-forced input tokens replaced by random ones (input_token_noise)",
    )
    parser.add_argument(
        "--adapt-whole-model",
        action="store_true",
        help="train every parameter (as the seed pretraining) instead of the federated set",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s - %(message)s")

    manifests = args.manifests or args.corpus.rstrip("/") + "_gap"
    prepare_mls(args.corpus, manifests, splits=("train", "test", "public_test", "public"))
    voices = speaker_voices(args.corpus)
    test_rows = _rows(os.path.join(manifests, "test.csv"))
    masks = subsets(test_rows, voices)
    index = {r["ID"]: i for i, r in enumerate(test_rows)}
    report = {"subset_utterances": {k: int(v.sum()) for k, v in masks.items()}}

    def take(details, mask):
        return details.take([i for i, key in enumerate(details.ids) if mask[index[key]]])

    print(f"{'set':34} {'utts':>5}  WER [95% CI]")
    if args.seed_model:
        torch.manual_seed(0)
        model = build_speech_llm(
            args.seed_model, cache_dir=os.path.dirname(args.seed_model), lora_r=0,
            freeze_encoder=False, prompt=args.prompt,
        )  # fmt: skip
        model.eval()
        seed = {}
        for split in ("public_test", "test"):
            details = evaluate(
                model,
                os.path.join(manifests, f"{split}.csv"),
                args.corpus,
                max_new_tokens=args.max_new_tokens,
            )
            seed[split] = details
        sets = {
            "public_test (public domain)": seed["public_test"],
            "test (client domain)": seed["test"],
        }
        sets.update({f"  test, {k}": take(seed["test"], m) for k, m in masks.items()})
        report["seed"] = {}
        for name, details in sets.items():
            if not details.ids:
                print(f"seed  {name:28} {0:>5}  (none)")
                continue
            interval = bootstrap_details(details, num_resamples=args.resamples)
            report["seed"][name.strip()] = interval.to_dict()
            print(f"seed  {name:28} {len(details.ids):>5}  {_fmt(interval)}")
    if args.seed_model and args.adapt_steps:
        torch.manual_seed(0)
        model = build_speech_llm(
            args.seed_model, cache_dir=os.path.dirname(args.seed_model),
            lora_r=0 if args.adapt_whole_model else 8, freeze_encoder=False, ctc_weight=0.5,
            prompt=args.prompt,
        )  # fmt: skip
        model.input_token_noise = args.adapt_input_noise
        if not args.adapt_whole_model and args.adapt_part != "all":
            keep = {
                "audio": lambda n: model.component_of(n) != "llm",
                "encoder": lambda n: model.component_of(n) == "encoder",
                "llm": lambda n: n.startswith("llm."),
            }[args.adapt_part]
            for name, param in model.named_parameters():
                param.requires_grad_(param.requires_grad and keep(name))
        logging.info(
            "central adaptation trains %d values",
            sum(p.numel() for p in model.parameters() if p.requires_grad),
        )
        data_csv = os.path.join(
            manifests, "public.csv" if args.adapt_on == "public" else "train.csv"
        )
        if args.adapt_on == "train_public_words":
            rows = _rows(data_csv)
            keep = [r for r in rows if not set(r["wrd"].split()) & novel_words(r["language"])]
            data_csv = os.path.join(manifests, "train_public_words.csv")
            with open(data_csv, "w", newline="", encoding="utf-8") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(keep)
        loader = sb.dataio.dataloader.make_dataloader(
            make_dataset(data_csv, args.corpus), batch_size=args.batch_size, shuffle=True
        )
        history = pretrain_seed_model(
            model, _Batches(loader), steps=args.adapt_steps, lr=args.adapt_lr,
            warmup_steps=min(30, args.adapt_steps // 10), train_base=args.adapt_whole_model,
            log_every=25,
        )  # fmt: skip
        adapted = evaluate(
            model, os.path.join(manifests, "test.csv"), args.corpus,
            max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
        adapted_public = evaluate(
            model, os.path.join(manifests, "public_test.csv"), args.corpus,
            max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
        ce = history["ce"]
        report["central_adaptation"] = {
            "steps": args.adapt_steps, "lr": args.adapt_lr, "data": args.adapt_on,
            "part": args.adapt_part, "input_noise": args.adapt_input_noise,
            "whole_model": args.adapt_whole_model, "seconds": round(history["seconds"], 1),
            "ce_first_25": float(np.nanmean(ce[:25])), "ce_last_25": float(np.nanmean(ce[-25:])),
            "public_test": bootstrap_details(adapted_public, num_resamples=args.resamples).to_dict(),
        }  # fmt: skip
        print(
            f"\ncentral adaptation on {args.adapt_on}: {args.adapt_steps} steps, lr {args.adapt_lr}"
            f"{', whole model' if args.adapt_whole_model else ''}; cross-entropy "
            f"{np.nanmean(ce[:25]):.2f} -> {np.nanmean(ce[-25:]):.2f}; public_test WER "
            f"{seed['public_test'].wer:.3f} -> {adapted_public.wer:.3f}"
        )
        for name, mask in {"test": np.ones(len(test_rows), bool), **masks}.items():
            if not mask.any():
                continue
            a, b = take(adapted, mask), take(seed["test"], mask)
            cmp = paired_bootstrap_details(
                a, b, names=("adapted", "seed"), num_resamples=args.resamples
            )
            report["central_adaptation"][name] = cmp.to_dict()
            print(
                f"{name:34} {len(a.ids):>5}  {cmp.wer_b:.3f}  {cmp.wer_a:.3f}  "
                f"{cmp.difference:+.3f} [{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}]  "
                f"{cmp.difference / max(cmp.wer_b, 1e-9):+.0%}"
            )
    if args.run:
        before = read_utterance_details(os.path.join(args.run, "test_utterances_round0.csv"))
        after = read_utterance_details(os.path.join(args.run, "test_utterances.csv"))
        report["run"] = {}
        print(f"\n{'run: final - round 0':34} {'utts':>5}  round0  final  change [95% CI]  rel.")
        for name, mask in {"test": np.ones(len(test_rows), bool), **masks}.items():
            if not mask.any():
                continue
            a, b = take(after, mask), take(before, mask)
            cmp = paired_bootstrap_details(
                a, b, names=("final", "round0"), num_resamples=args.resamples
            )
            report["run"][name] = cmp.to_dict()
            print(
                f"{name:34} {len(a.ids):>5}  {cmp.wer_b:.3f}  {cmp.wer_a:.3f}  "
                f"{cmp.difference:+.3f} [{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}]  "
                f"{cmp.difference / max(cmp.wer_b, 1e-9):+.0%}"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""How well the tiny seed model of the MLS recipe reads unseen synthetic voices.

Generates the embedded corpus (``speechbrain_fl.data.mls_synth``) with the given public-split
size, pretrains the ``tiny`` speech-LLM on its public split exactly as ``recipes/MLS/train_fl.py``
does (``pretrain_seed_model``: CTC-only warm-up, then encoder + connector + LLM jointly), and
prints the WER of LLM greedy decoding and of the CTC head (greedy, blanks and repeats removed)
on public (training) voices, on ``public_test`` (unseen speakers of the public text and voice
domain) and on the client-domain train/dev/test speakers, plus the time per step. Public vs
public_test tells memorised voices from learnt speech; public_test vs test is the domain gap
the federated stage has to close (``benchmarks/mls_domain_gap.py`` breaks it down).

This is the measurement behind the seed-model paragraph of ``recipes/MLS/README.md`` (voices,
language prompt, steps). The 25 Hz encoder rate is a constant of ``speechbrain_fl/models/tiny.py``
and is not an option here.

Run (about 5 min for the defaults on 2 cores, more with a cold corpus cache)::

    python benchmarks/seed_model.py --public-speakers 64 --steps 2400
    python benchmarks/seed_model.py --public-speakers 16 --steps 1200 --prompt "transcribe:"
"""

import argparse
import json
import os
import sys
import tempfile
import time

import speechbrain as sb
import torch

from speechbrain_fl.data.mls_synth import generate_mls_corpus
from speechbrain_fl.models.presets import build_speech_llm
from speechbrain_fl.models.pretrain import pretrain_seed_model

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "MLS")
sys.path.insert(0, RECIPE)
from mls_prepare import prepare_mls  # noqa: E402
from mls_seed_model import _Batches  # noqa: E402
from train_fl import make_dataset  # noqa: E402

LANGUAGES = ["english", "german", "dutch", "french", "spanish", "italian", "portuguese", "polish"]


def ctc_greedy(model, frames, lengths) -> list[str]:
    """Best-path CTC transcripts of the auxiliary head (blank = last class)."""
    ids = model.ctc_head(frames).argmax(-1)
    blank = model.ctc_head.out_features - 1
    texts = []
    for row, length in zip(ids.tolist(), lengths.tolist(), strict=True):
        out, prev = [], None
        for token in row[:length]:
            if token not in (prev, blank):
                out.append(token)
            prev = token
        texts.append(model.tokenizer.decode(out).strip())
    return texts


def evaluate(model, csv_path, data_folder, *, limit, max_new_tokens) -> dict:
    """LLM and CTC word error rates (in [0, 1]) on up to ``limit`` utterances of a manifest."""
    loader = sb.dataio.dataloader.make_dataloader(
        make_dataset(csv_path, data_folder), batch_size=32, shuffle=False
    )
    llm_wer, ctc_wer = (
        sb.utils.metric_stats.ErrorRateStats(),
        sb.utils.metric_stats.ErrorRateStats(),
    )
    seen = 0
    with torch.no_grad():
        for batch in loader:
            wavs, lens = batch.sig
            languages = list(batch.language)
            refs = [text.split() for text in batch.wrd]
            hyps = model.transcribe(wavs, lens, max_new_tokens=max_new_tokens, languages=languages)
            frames, enc_lens, _, _ = model.encode(wavs, lens)
            llm_wer.append(batch.id, [h.split() for h in hyps], refs)
            ctc_wer.append(batch.id, [h.split() for h in ctc_greedy(model, frames, enc_lens)], refs)
            seen += len(batch.id)
            if limit and seen >= limit:
                break
    return {
        "utterances": seen,
        "llm_wer": llm_wer.summarize("error_rate") / 100,
        "ctc_wer": ctc_wer.summarize("error_rate") / 100,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--public-speakers", type=int, default=64, help="per language")
    parser.add_argument("--public-utterances", type=int, default=8, help="per public speaker")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--ctc-steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--downsample-k", type=int, default=2)
    parser.add_argument("--prompt", default="transcribe {language}")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "sbfl_seed_bench"))
    args = parser.parse_args()

    corpus = os.path.join(args.cache, f"mls_pub{args.public_speakers}x{args.public_utterances}")
    start = time.perf_counter()
    generate_mls_corpus(
        corpus,
        languages=LANGUAGES,
        speakers_per_language=4,
        utterances_per_speaker=16,
        public_speakers_per_language=args.public_speakers,
        public_utterances_per_speaker=args.public_utterances,
        eval_utterances_per_speaker=6,
        seed=args.seed,
    )
    manifests = corpus + "_manifests"
    prepare_mls(corpus, manifests, splits=("train", "dev", "test", "public", "public_test"))
    corpus_s = time.perf_counter() - start

    torch.manual_seed(args.seed)
    model = build_speech_llm(
        "tiny",
        cache_dir=args.cache,
        freeze_encoder=False,
        lora_r=0,
        downsample_k=args.downsample_k,
        ctc_weight=0.5,
        prompt=args.prompt,
        seed=args.seed,
    )
    loader = sb.dataio.dataloader.make_dataloader(
        make_dataset(os.path.join(manifests, "public.csv"), corpus),
        batch_size=args.batch_size,
        shuffle=True,
    )
    history = pretrain_seed_model(
        model,
        _Batches(loader),
        steps=args.steps,
        lr=args.lr,
        warmup_steps=min(30, args.steps // 10),
        ctc_warmup_steps=args.ctc_steps,
        log_every=0,
    )
    report = {"options": vars(args), "corpus_s": round(corpus_s, 1)}
    report["pretraining_s"] = round(history["seconds"], 1)
    report["ms_per_step"] = round(1000 * history["seconds"] / args.steps, 1)
    splits = ("public", "public_test", "train", "dev", "test")
    for split in splits:
        limit = 160 if split == "public" else None
        report[split] = evaluate(
            model,
            os.path.join(manifests, f"{split}.csv"),
            corpus,
            limit=limit,
            max_new_tokens=args.max_new_tokens,
        )
    print(f"{'split':11} {'utts':>5} {'LLM WER':>8} {'CTC WER':>8}")
    for split in splits:
        r = report[split]
        print(f"{split:11} {r['utterances']:>5} {r['llm_wer']:>8.3f} {r['ctc_wer']:>8.3f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

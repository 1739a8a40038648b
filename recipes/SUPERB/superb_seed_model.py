"""The SUPERB recipe's seed model: the tiny multi-exit wav2vec 2.0 pretrained on a public split.

Built once per options by :func:`speechbrain_fl.recipe.cached_seed_model` (key, build, save)
and trained by :func:`speechbrain_fl.models.pretrain.train_steps` (the package's central
training loop); what is the recipe's own is the objective (``pretrain_objective``).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import logging

import numpy as np
import speechbrain as sb
import torch
from superb_data import CTC_ALPHABET, make_dataset

from speechbrain_fl.recipe import cache_tag, cached_seed_model, file_digest

logger = logging.getLogger("superb_task")

__all__ = ["seed_model_folder"]


def seed_model_folder(hparams, public):
    """The backbone to start from: a real preset, or the tiny model pretrained centrally.

    The tiny preset is random; it is trained centrally on the generated ``public``
    LibriSpeech-style split (voices drawn apart from the task corpora), saved with
    ``save_pretrained`` into the cache (keyed by the options and the split's content) and loaded
    back by ``Wav2Vec2Model.from_pretrained``. ``pretrain_objective`` (ours):

    - ``none`` (default): the random tiny model, no pretraining (random initialisation
      everywhere; the bag-of-words seed was measured to transfer nothing);
    - ``bag_of_words``: predict which words of the sentence vocabulary occur
      (multi-label BCE) from the stat-pooled hidden state of *every* exit, losses summed, so
      each exit's representation becomes content-aware;
    - ``ctc``: character CTC after layer 12, the objective of the paper's initialisation
      (LibriSpeech-100h fine-tuning). Measured here: 200 CPU steps leave it in CTC's all-blank
      phase (loss 2.9), and KWS federated training from that seed stalled at ln 12, so it is
      not the default for the short embedded pretraining.
    """
    from speechbrain_fl.models.multi_exit_wav2vec2 import (
        MultiExitWav2Vec2,
        resolve_backbone,
        tiny_config_tag,
    )

    if hparams["model"] != "tiny":
        return resolve_backbone(hparams["model"], cache_dir=hparams["cache_folder"]), {}
    objective = hparams["pretrain_objective"]
    if objective == "none":  # random initialisation (the default: see the README)
        return resolve_backbone("tiny", cache_dir=hparams["cache_folder"], seed=hparams["seed"]), {}
    if objective not in ("bag_of_words", "ctc"):
        raise ValueError(
            f"pretrain_objective: {objective!r} must be 'none', 'bag_of_words' or 'ctc'"
        )
    csv_path, data_folder = public
    key = {
        "tiny": tiny_config_tag(),
        "objective": objective,
        "steps": hparams["pretrain_steps"],
        "lr": hparams["pretrain_lr"],
        "batch_size": hparams["pretrain_batch_size"],
        "seed": hparams["seed"],
        "public": file_digest(csv_path),
    }

    def build(folder):
        from transformers import Wav2Vec2Model

        from speechbrain_fl.models.pretrain import train_steps

        source = resolve_backbone("tiny", cache_dir=hparams["cache_folder"], seed=hparams["seed"])
        # The seed model's own seed (its key holds it): the heads' initialisation and the
        # loader's shuffling of this one-off step, whatever ran before in the process.
        torch.manual_seed(hparams["seed"])
        with open(csv_path, newline="", encoding="utf-8") as handle:
            vocab = sorted({w for row in csv.DictReader(handle) for w in row["wrd"].split()})
        ctc = objective == "ctc"
        model = MultiExitWav2Vec2(
            Wav2Vec2Model.from_pretrained(source),
            num_outputs=len(CTC_ALPHABET) + 1 if ctc else len(vocab),
            exits=(12,) if ctc else (3, 6, 9, 12),
            head="ctc" if ctc else "utterance",
        )
        index = {w: i for i, w in enumerate(vocab)}
        dataset = make_dataset(csv_path, data_folder, ctc=True).filtered_sorted(sort_key="duration")
        loader = sb.dataio.dataloader.make_dataloader(
            dataset, batch_size=hparams["pretrain_batch_size"], shuffle=True
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=hparams["pretrain_lr"])
        steps = hparams["pretrain_steps"]
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=hparams["pretrain_lr"], total_steps=steps, pct_start=0.1
        )

        def loss_fn(batch):
            wavs, lens = batch.sig
            if ctc:  # character CTC after layer 12
                tokens, token_lens = batch.tokens
                return torch.nn.functional.ctc_loss(
                    model(wavs, lens, depth=12).transpose(0, 1),
                    tokens,
                    model.frame_lengths(wavs, lens),
                    torch.round(token_lens * tokens.shape[1]).long(),
                    blank=0,
                    zero_infinity=True,
                )
            # bag of words: which vocabulary words occur, from every exit, losses summed
            target = torch.zeros(len(batch.wrd), len(vocab))
            for i, text in enumerate(batch.wrd):
                target[i, [index[w] for w in text.split()]] = 1.0
            outputs = model.forward_exits(wavs, lens, exits=model.exits)
            return sum(
                torch.nn.functional.binary_cross_entropy_with_logits(out, target)
                for out in outputs.values()
            )

        losses = train_steps(
            model,
            loader,
            loss_fn,
            optimizer=optimizer,
            scheduler=scheduler,
            steps=steps,
            max_grad_norm=5.0,
            desc=f"seed model pretraining ({objective})",
        )
        model.backbone.save_pretrained(folder)
        logger.info(
            "Seed model pretrained (%s loss %.3f -> %.3f)",
            objective,
            float(np.mean(losses[:20])),
            float(np.mean(losses[-20:])),
        )

    logger.debug("seed model key %s -> tag %s", key, cache_tag(key))
    return cached_seed_model(
        cache_folder=hparams["cache_folder"],
        prefix="seed_wav2vec2_tiny",
        key=key,
        build=build,
        marker="config.json",
    )

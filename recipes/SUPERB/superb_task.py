"""The SUPERB federated task: Brain, data pipelines, seed model, ClientApp/ServerApp builders.

``superb_task(hparams, overrides) -> FLTask`` is the recipe's task factory. Both engines reach
it through a :class:`~speechbrain_fl.fl.task.TaskSpec` naming this file
(``recipes/SUPERB/superb_task.py:superb_task``): ``train_fl.py`` hands the spec to the
Simulation Engine, whose Ray actors load the factory themselves, and ``flwr run`` names it in
the run config. It lives in its own module (not in ``train_fl.py``, which runs as
``__main__``) so every process imports the same module once and keeps one model per process.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import speechbrain as sb
import torch

RECIPE_DIR = Path(__file__).resolve().parent
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

from superb_data import TASKS, check_task, prepare_task  # noqa: E402

from speechbrain_fl.atomic import atomic_folder, atomic_open  # noqa: E402
from speechbrain_fl.recipe import load_layered_hparams  # noqa: E402

logger = logging.getLogger(__name__)

SCENARIOS = ("centralized", "homogeneous", "heterogeneous")
CTC_ALPHABET = " 'abcdefghijklmnopqrstuvwxyz"  # id 0 is the CTC blank


# ##########################################################################################
# Brain
# ##########################################################################################
class SuperbBrain(sb.Brain):
    """Trains one exit (``self.depth``); evaluates every exit in ``self.eval_exits``.

    Training runs the truncated forward (layers 1..depth) and the loss at exit ``depth`` only;
    evaluation runs one pass to the deepest evaluated exit and scores every exit.
    """

    depth: int = 12
    eval_exits: tuple[int, ...] = (12,)

    def compute_forward(self, batch, stage):
        """Exit outputs: ``{depth: logits}`` in training, every evaluated exit otherwise."""
        batch = batch.to(self.device)
        wavs, lens = batch.sig
        model = self.modules.model
        if stage == sb.Stage.TRAIN:
            return {self.depth: model(wavs, lens, depth=self.depth)}, lens
        return model.forward_exits(wavs, lens, exits=self.eval_exits), lens

    def compute_objectives(self, predictions, batch, stage):
        """Cross-entropy (utterance tasks) or CTC (ASR) at the trained / deepest exit."""
        outputs, lens = predictions
        model = self.modules.model
        if model.head_type == "ctc":
            tokens, token_lens = batch.tokens
            frames = model.frame_lengths(batch.sig[0], lens)
            losses = {
                e: torch.nn.functional.ctc_loss(
                    out.transpose(0, 1),
                    tokens,
                    frames,
                    torch.round(token_lens * tokens.shape[1]).long(),
                    blank=0,
                    zero_infinity=True,
                )
                for e, out in outputs.items()
            }
            if stage != sb.Stage.TRAIN:
                for e, out in outputs.items():
                    hyps = sb.decoders.ctc_greedy_decode(out, frames.float() / out.shape[1], 0)
                    self.wer[e].append(
                        ids=batch.id,
                        predict=[decode_chars(h).split() for h in hyps],
                        target=[w.split() for w in batch.wrd],
                    )
        else:
            target = batch.label_id.data[:, 0]
            losses = {
                e: torch.nn.functional.cross_entropy(out, target) for e, out in outputs.items()
            }
            if stage != sb.Stage.TRAIN:
                for e, out in outputs.items():
                    self.predictions[e].extend(out.argmax(-1).tolist())
                self.records.extend(zip(batch.id, batch.spk_id, target.tolist(), strict=True))
        return losses[max(losses)]

    def on_fit_start(self):
        """Re-decide L_max for this round when the client declared a memory budget (ours)."""
        rule = getattr(self, "depth_rule", None)
        if rule is not None:
            depth = rule()
            if depth is None:
                raise RuntimeError("memory budget fits no exit; this client should be excluded")
            self.depth = depth
        # transformers draws SpecAugment masks from numpy's global generator: tie it to the
        # torch seed the engine set for this client and round, so a run is reproducible
        np.random.seed(torch.initial_seed() % 2**32)
        super().on_fit_start()

    def init_optimizers(self):
        """AdamW over the trainable tensors (tensors without a gradient are skipped)."""
        params = [p for p in self.modules.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        self.optimizers_dict = {"optimizer": self.optimizer}

    def on_stage_start(self, stage, epoch=None):
        """Fresh per-exit accumulators for evaluation stages."""
        if stage != sb.Stage.TRAIN:
            self.predictions = {e: [] for e in self.eval_exits}
            self.records = []
            self.wer = {e: sb.utils.metric_stats.ErrorRateStats() for e in self.eval_exits}

    def on_stage_end(self, stage, stage_loss, epoch=None):
        """Store the stage's metrics per exit in ``last_stats``."""
        stats = {"loss": stage_loss}
        if stage != sb.Stage.TRAIN:
            for e in self.eval_exits:
                if self.modules.model.head_type == "ctc":
                    stats[f"wer_{e}"] = self.wer[e].summarize("error_rate") / 100.0
                else:
                    labels = np.array([r[2] for r in self.records])
                    stats[f"acc_{e}"] = float((np.array(self.predictions[e]) == labels).mean())
        self.last_stats = stats


def decode_chars(ids):
    """CTC ids (blank-free) to text."""
    return "".join(CTC_ALPHABET[i - 1] for i in ids if 0 < i <= len(CTC_ALPHABET))


def encode_chars(text):
    """Text to CTC ids (characters outside the alphabet dropped)."""
    return [CTC_ALPHABET.index(c) + 1 for c in text.lower() if c in CTC_ALPHABET]


# ##########################################################################################
# Data
# ##########################################################################################
def make_dataset(csv_path, data_folder, *, labels=None, ctc=False):
    """A DynamicItemDataset: ``sig`` (16 kHz), ``spk_id`` and ``label_id`` or ``tokens``."""
    dataset = sb.dataio.dataset.DynamicItemDataset.from_csv(
        csv_path=csv_path, replacements={"data_root": data_folder}
    )
    has_crop = "start" in dataset.data[next(iter(dataset.data))]

    if has_crop:

        @sb.utils.data_pipeline.takes("wav", "start", "stop")
        @sb.utils.data_pipeline.provides("sig")
        def audio(wav, start, stop):
            if int(stop) > 0:
                return sb.dataio.dataio.read_audio(
                    {"file": wav, "start": int(start), "stop": int(stop)}
                )
            return sb.dataio.dataio.read_audio(wav)

    else:

        @sb.utils.data_pipeline.takes("wav")
        @sb.utils.data_pipeline.provides("sig")
        def audio(wav):
            return sb.dataio.dataio.read_audio(wav)

    keys = ["id", "sig", "spk_id"]
    items = [audio]
    if ctc:

        @sb.utils.data_pipeline.takes("wrd")
        @sb.utils.data_pipeline.provides("wrd", "tokens")
        def text(wrd):
            yield wrd
            yield torch.LongTensor(encode_chars(wrd))

        items.append(text)
        keys += ["wrd", "tokens"]
    else:
        index = {label: i for i, label in enumerate(labels)}

        @sb.utils.data_pipeline.takes("label")
        @sb.utils.data_pipeline.provides("label_id")
        def label(value):
            if value not in index:
                raise KeyError(f"{csv_path}: label {value!r} is not one of {labels}")
            return torch.LongTensor([index[value]])

        items.append(label)
        keys.append("label_id")
    for item in items:
        sb.dataio.dataset.add_dynamic_item([dataset], item)
    sb.dataio.dataset.set_output_keys([dataset], keys)
    return dataset


# ##########################################################################################
# Seed model (tiny preset): central pretraining on the public split
# ##########################################################################################
def seed_model_folder(hparams, public):
    """The backbone to start from: a real preset, or the tiny model pretrained centrally.

    The tiny preset is random; it is trained centrally on the generated ``public``
    LibriSpeech-style split (voices drawn apart from the task corpora), saved with
    ``save_pretrained`` into the cache (keyed by the options and the split's content) and loaded
    back by ``Wav2Vec2Model.from_pretrained``. ``pretrain_objective`` (ours):

    - ``bag_of_words`` (default): predict which words of the sentence vocabulary occur
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
    if objective not in ("bag_of_words", "ctc"):
        raise ValueError(f"pretrain_objective: {objective!r} must be 'bag_of_words' or 'ctc'")
    csv_path, data_folder = public
    key = {
        "tiny": tiny_config_tag(),
        "objective": objective,
        "steps": hparams["pretrain_steps"],
        "lr": hparams["pretrain_lr"],
        "batch_size": hparams["pretrain_batch_size"],
        "seed": hparams["seed"],
        "public": hashlib.sha256(Path(csv_path).read_bytes()).hexdigest(),
    }
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(hparams["cache_folder"]) / f"seed_wav2vec2_tiny_{tag}"
    if (folder / "config.json").is_file():
        logger.info("Reusing the pretrained tiny seed model in %s", folder)
        return str(folder), {}
    from tqdm.auto import tqdm
    from transformers import Wav2Vec2Model

    start = time.time()
    source = resolve_backbone("tiny", cache_dir=hparams["cache_folder"], seed=hparams["seed"])
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
    model.train()
    losses, step = [], 0
    with tqdm(total=steps, desc=f"seed model pretraining ({objective})", unit="step") as bar:
        while step < steps:
            for batch in loader:
                wavs, lens = batch.sig
                if ctc:
                    tokens, token_lens = batch.tokens
                    loss = torch.nn.functional.ctc_loss(
                        model(wavs, lens, depth=12).transpose(0, 1),
                        tokens,
                        model.frame_lengths(wavs, lens),
                        torch.round(token_lens * tokens.shape[1]).long(),
                        blank=0,
                        zero_infinity=True,
                    )
                else:
                    target = torch.zeros(len(batch.wrd), len(vocab))
                    for i, text in enumerate(batch.wrd):
                        target[i, [index[w] for w in text.split()]] = 1.0
                    outputs = model.forward_exits(wavs, lens, exits=model.exits)
                    loss = sum(
                        torch.nn.functional.binary_cross_entropy_with_logits(out, target)
                        for out in outputs.values()
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
                if step >= steps:
                    break
    with atomic_folder(folder) as tmp:
        model.backbone.save_pretrained(tmp)
    seconds = time.time() - start
    logger.info(
        "Seed model saved to %s (%.1f s, %s loss %.3f -> %.3f)",
        folder,
        seconds,
        objective,
        float(np.mean(losses[:20])),
        float(np.mean(losses[-20:])),
    )
    return str(folder), {"pretraining": seconds}


# ##########################################################################################
# Model and Brain construction (one model per worker process)
# ##########################################################################################
_WORKER_MODELS: dict = {}


def build_model(settings):
    """The multi-exit model from the seed folder (cached per process)."""
    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit

    key = json.dumps(settings["model"], sort_keys=True)
    if key not in _WORKER_MODELS:
        _WORKER_MODELS.clear()
        options = settings["model"]
        _WORKER_MODELS[key] = build_multi_exit(
            options["source"],
            num_outputs=options["num_outputs"],
            cache_dir=options["cache_dir"],
            exits=options["exits"],
            head=options["head"],
            freeze_feature_encoder=options["freeze_feature_encoder"],
            seed=options["seed"],
        ).to(settings["run_opts"].get("device") or "cpu")
    return _WORKER_MODELS[key]


def build_brain(settings, *, depth=None):
    """A SuperbBrain training exit ``depth`` and evaluating ``settings['eval_exits']``."""
    brain = SuperbBrain(
        modules={"model": build_model(settings)},
        hparams=settings["hparams"],
        run_opts=dict(settings["run_opts"]),
        checkpointer=None,
    )
    brain.depth = int(depth or max(settings["eval_exits"]))
    brain.eval_exits = tuple(settings["eval_exits"])
    return brain


def _reply_partial(brain):
    """The tensors a client trained (layers <= depth, its exit head, below) and its depth."""
    return brain.modules.model.trained_parameter_names(brain.depth, prefix="model."), {
        "exit-depth": brain.depth
    }


# ##########################################################################################
# Federated task (Flower ClientApp / ServerApp builders)
# ##########################################################################################
def build_client(context, *, settings):
    """ClientApp builder: this partition's Brain (at its exit) and training set."""
    from speechbrain_fl.fl.client import ClientTask

    partition_id = int(context.node_config["partition-id"])
    torch.set_num_threads(max(1, min(int(settings["cpus_per_client"]), settings["num_threads"])))
    brain = build_brain(settings, depth=settings["depths"][partition_id])
    budget = settings["budgets"][partition_id] if settings["budgets"] else None
    if budget is not None:
        brain.depth_rule = functools.partial(
            budget_depth, budget_mb=budget, budget_settings=settings["budget_settings"]
        )
    return ClientTask(
        brain=brain,
        train_set=make_dataset(
            settings["clients"][partition_id], settings["data_folder"], **settings["data_kw"]
        ),
        train_loader_kwargs=dict(settings["hparams"]["dataloader_options"]),
        partial=_reply_partial,
    )


def evaluate_exits(brain, dataset, settings):
    """Validation metrics per evaluated exit (``acc_<e>`` or ``wer_<e>``)."""
    brain.evaluate(
        dataset,
        progressbar=False,
        test_loader_kwargs=dict(settings["hparams"]["eval_dataloader_options"]),
    )
    return {k: float(v) for k, v in brain.last_stats.items() if k != "loss"}


def build_server(context, *, settings, fl_config):
    """ServerApp builder: the global model, the config and per-exit validation."""
    from speechbrain_fl.fl.server import ServerTask

    brain = build_brain(settings)
    valid_set = make_dataset(settings["valid_csv"], settings["data_folder"], **settings["data_kw"])
    return ServerTask(
        brain=brain,
        config=fl_config,
        evaluate=functools.partial(evaluate_exits, dataset=valid_set, settings=settings),
        min_available_nodes=len(settings["clients"]),
        num_partitions=len(settings["clients"]),
    )


def client_depths(hparams, num_clients):
    """L_max per client: one exit for all (homogeneous) or the paper's 50/50 groups.

    Heterogeneous: a seeded permutation of the clients puts ``round(shallow_fraction * K)`` of
    them at ``shallow_exit`` (the paper's low-resource group, layer 3) and the rest at the deep
    exit (``exit`` if given, else the task's ``best_exit``). The groups model hardware, so a
    client keeps its depth in every round.
    """
    deep = int(hparams["exit"] or hparams["best_exit"])
    if hparams["scenario"] != "heterogeneous":
        return [deep] * num_clients
    order = np.random.default_rng(hparams["seed"]).permutation(num_clients)
    shallow = set(order[: int(round(hparams["shallow_fraction"] * num_clients))].tolist())
    return [int(hparams["shallow_exit"]) if i in shallow else deep for i in range(num_clients)]


def budget_depth(*, budget_mb, budget_settings):
    """Deepest exit <= the task cap whose measured peak training memory fits ``budget_mb``.

    Ours (the paper decides L_max from "local hardware resources" without a rule). The peak
    memory per exit is measured once per model and batch shape (a fresh subprocess per depth on
    CPU) and cached in ``<cache_folder>/exit_memory.json``; every later call, e.g. each round,
    reads the cache. Returns ``None`` when even the shallowest exit does not fit.
    """
    from speechbrain_fl.models.exit_memory import choose_depth, peak_training_memory

    b = budget_settings
    measure = functools.partial(
        peak_training_memory,
        b["source"],
        batch_size=b["batch_size"],
        seconds=b["seconds"],
        head=b["head"],
        num_outputs=b["num_outputs"],
        freeze_feature_encoder=b["freeze_feature_encoder"],
        device=b["device"],
    )
    return choose_depth(
        budget_mb=budget_mb,
        exits=b["exits"],
        cap=b["cap"],
        measure=lambda depth: measure(depth=depth)["peak_mb"],
        cache_file=b["cache_file"],
        cache_key=budget_cache_key(b),
    )


def budget_cache_key(budget_settings):
    """Key of a model, batch shape and options in the memory cache file."""
    return json.dumps(
        {k: v for k, v in budget_settings.items() if k != "cache_file"}, sort_keys=True
    )


def budget_settings_for(hparams, settings):
    """What :func:`budget_depth` measures with: model, batch shape, exits, cap, cache file."""
    model = settings["model"]
    return {
        "source": model["source"],
        "batch_size": int(hparams["batch_size"]),
        "seconds": float(TASKS[hparams["task"]]["seconds"]),
        "head": model["head"],
        "num_outputs": model["num_outputs"],
        "freeze_feature_encoder": model["freeze_feature_encoder"],
        "device": (settings["run_opts"].get("device") or "cpu"),
        "exits": model["exits"],
        "cap": int(hparams["exit"] or hparams["best_exit"]),
        "cache_file": os.path.join(hparams["cache_folder"], "exit_memory.json"),
    }


def apply_memory_budgets(hparams, settings):
    """Depth policy ``memory_budget`` (ours): L_max per client from its declared budget.

    Budgets come from ``client_memory_budgets_mb`` (cycled over the clients). A client whose
    budget fits no exit is excluded with a log line, or trains the shallowest exit when
    ``budget_fallback: shallowest``. Returns the decisions (logged and kept in results.json).
    """
    budgets = list(hparams["client_memory_budgets_mb"] or [])
    if not budgets:
        raise ValueError("depth_policy: memory_budget needs client_memory_budgets_mb (a list)")
    model = settings["model"]
    settings["budget_settings"] = budget_settings_for(hparams, settings)
    clients, depths, kept_budgets, decisions = [], [], [], []
    for i, manifest in enumerate(settings["clients"]):
        budget = float(budgets[i % len(budgets)])
        depth = budget_depth(budget_mb=budget, budget_settings=settings["budget_settings"])
        action = "trains" if depth is not None else hparams["budget_fallback"]
        if depth is None and hparams["budget_fallback"] == "shallowest":
            depth = min(model["exits"])
        if depth is None:
            logger.warning(
                "client %d: memory budget %.0f MB fits no exit <= %d; excluded",
                i,
                budget,
                settings["budget_settings"]["cap"],
            )
        else:
            clients.append(manifest)
            depths.append(depth)
            kept_budgets.append(budget)
            logger.info(
                "client %d: memory budget %.0f MB -> exit %d (%s)", i, budget, depth, action
            )
        decisions.append({"client": i, "budget_mb": budget, "exit": depth, "action": action})
    if not clients:
        raise ValueError(f"no client's memory budget fits any exit (budgets {budgets} MB)")
    settings.update(clients=clients, depths=depths, budgets=kept_budgets)
    settings["eval_exits"] = sorted(set(depths))
    return decisions


def fl_config(hparams):
    """The engine's FLConfig from the recipe's hparams, through the shared YAML vocabulary.

    :meth:`speechbrain_fl.fl.config.FLConfig.from_hparams` reads ``number_of_rounds``,
    ``method``, ``sampling_rate``, ``noise_multiplier``, ... like every recipe's. The one
    SUPERB difference: its ``aggregation`` (``layerwise`` | ``fedavg_full``) and ``weighting``
    keys name a registered rule of :mod:`speechbrain_fl.fl.layerwise`, passed as the config's
    ``aggregation`` field.

    Example
    -------
    >>> cfg = fl_config({"output_folder": "o", "number_of_rounds": 3, "method": "fedavg",
    ...     "aggregation": "layerwise", "weighting": "samples", "noise_multiplier": 0.0})
    >>> cfg.num_rounds, cfg.aggregation, cfg.private
    (3, 'layerwise_samples', False)
    """
    from speechbrain_fl.fl.config import FLConfig
    from speechbrain_fl.fl.layerwise import rule_name

    return FLConfig.from_hparams(
        hparams, aggregation=rule_name(hparams["aggregation"], hparams["weighting"])
    )


# ##########################################################################################
# Settings: hparams -> everything the builders need
# ##########################################################################################
BRAIN_KEYS = ("seed", "lr", "weight_decay", "dataloader_options", "eval_dataloader_options")


def check_hparams(hparams):
    """Fail fast, before anything heavy, on a task, scenario, exit or rule the run cannot use."""
    from speechbrain_fl.fl.layerwise import rule_name

    check_task(hparams["task"])
    if hparams["scenario"] not in SCENARIOS:
        raise ValueError(f"scenario: {hparams['scenario']!r} must be one of {list(SCENARIOS)}")
    exits = [int(e) for e in hparams["exits"]]
    for key in ("exit", "best_exit", "shallow_exit"):
        value = hparams[key]
        if value is not None and int(value) not in exits:
            raise ValueError(f"{key}: {value!r} is not one of the exits {exits}")
    rule_name(hparams["aggregation"], hparams["weighting"])
    if hparams.get("method", "fedavg") != "fedavg":
        raise ValueError(
            f"method: {hparams['method']!r}: the SUPERB recipe runs without clipping "
            "(method: fedavg); clipping partial (layer-wise) replies is not implemented"
        )
    if hparams["noise_multiplier"] > 0:
        from speechbrain_fl.fl.aggregation import get_rule

        rule = get_rule(rule_name(hparams["aggregation"], hparams["weighting"]))
        raise ValueError(
            f"noise_multiplier={hparams['noise_multiplier']}: a private run is refused with "
            f"aggregation {hparams['aggregation']!r}: {rule.dp_refusal}"
        )
    if hparams["depth_policy"] not in ("groups", "memory_budget"):
        raise ValueError(
            f"depth_policy: {hparams['depth_policy']!r} must be 'groups' or 'memory_budget'"
        )
    if hparams["budget_fallback"] not in ("exclude", "shallowest"):
        raise ValueError(
            f"budget_fallback: {hparams['budget_fallback']!r} must be 'exclude' or 'shallowest'"
        )
    if not 0.0 < hparams["shallow_fraction"] < 1.0:
        raise ValueError(f"shallow_fraction: {hparams['shallow_fraction']} must be in (0, 1)")


def trained_exits(hparams):
    """The exits a scenario trains (and reports)."""
    deep = int(hparams["exit"] or hparams["best_exit"])
    if hparams["scenario"] == "heterogeneous":
        return sorted({int(hparams["shallow_exit"]), deep})
    return [deep]


def make_settings(hparams, run_opts):
    """Prepare data and the seed model; return the picklable settings of the builders."""
    timings = {}
    start = time.time()
    data = prepare_task(hparams)
    timings["data"] = time.time() - start
    seed_source, info = seed_model_folder(hparams, data["public"])
    timings.update(info)
    spec = TASKS[hparams["task"]]
    ctc = spec["head"] == "ctc"
    num_clients = len(data["clients"])
    settings = {
        "hparams": {k: hparams[k] for k in BRAIN_KEYS},
        "run_opts": {
            k: v
            for k, v in run_opts.items()
            if k in ("device", "precision", "debug", "debug_batches", "debug_epochs")
        }
        | {"max_grad_norm": hparams["max_grad_norm"], "noprogressbar": True},
        "data_folder": data["data_folder"],
        "clients": data["clients"],
        "valid_csv": data["valid"],
        "test_csv": data["test"],
        "labels": data["labels"],
        "data_kw": {"ctc": True} if ctc else {"labels": data["labels"]},
        "extra": data.get("extra", {}),
        "cpus_per_client": hparams["num_cpus_per_client"],
        "num_threads": int(hparams["num_threads"]),
        "depths": client_depths(hparams, num_clients),
        "budgets": None,
        "eval_exits": trained_exits(hparams),
        "model": {
            "source": seed_source,
            "num_outputs": len(CTC_ALPHABET) + 1 if ctc else len(data["labels"]),
            "cache_dir": hparams["cache_folder"],
            "exits": [int(e) for e in hparams["exits"]],
            "head": spec["head"],
            "freeze_feature_encoder": hparams["freeze_feature_encoder"],
            "seed": hparams["seed"],
        },
        "timings": timings,
    }
    if hparams["depth_policy"] == "memory_budget":
        settings["depth_decisions"] = apply_memory_budgets(hparams, settings)
    return settings


def load_hparams(hparams_file, overrides=None, run_opts=None):
    """Layered hparams (task file on base.yaml), debug sizes applied, checked."""
    hparams, base_file, merged = load_layered_hparams(
        hparams_file, overrides, recipe_dir=RECIPE_DIR
    )
    if hparams["number_of_rounds"] is None:
        hparams["number_of_rounds"] = (
            hparams["embedded_rounds"]
            if hparams["data_folder"] is None
            else hparams["paper_rounds"]
        )
    if (run_opts or {}).get("debug"):  # --debug: tiny sizes, seconds to run
        hparams["number_of_rounds"] = min(2, hparams["number_of_rounds"])
        hparams["pretrain_steps"] = min(3, hparams["pretrain_steps"])
        hparams["centralized_epochs"] = min(2, hparams["centralized_epochs"])
        hparams["bootstrap_resamples"] = min(200, hparams["bootstrap_resamples"])
        hparams["measure_memory"] = False
    check_hparams(hparams)
    return hparams, base_file, merged


# Preparation keys: every hparams value that is plain data (numbers, strings, lists,
# mappings); objects (the train logger) are left out. A change of any of them prepares again
# (the corpus and the seed model are cached on disk, so that is cheap).
_PLAIN = (str, int, float, bool, type(None), list, dict)


def prepare_settings(hparams, run_opts):
    """:func:`make_settings` once per run (:func:`speechbrain_fl.recipe.prepare_once`).

    The first process of a run (the script, or the ServerApp of ``flwr run``) prepares the data
    and the seed model and writes ``<save_folder>/prepared.json``; the others (Ray actors,
    SuperNodes, ClientApps) read it, so no process rewrites a file another one is reading.
    """
    from speechbrain_fl.recipe import prepare_once

    key = {k: v for k, v in hparams.items() if isinstance(v, _PLAIN) and not k.startswith("__")}
    key["run_opts"] = dict(run_opts)
    return prepare_once(hparams["save_folder"], key, lambda: make_settings(hparams, run_opts))


def setup_run(hparams_path, overrides=None):
    """Hparams, run options and prepared settings of a run, from one overrides mapping.

    Arguments
    ---------
    hparams_path : str or PathLike
        A task file (``hparams/kws.yaml``: relative to the working directory, then to the
        repository root, then to this folder).
    overrides : mapping, optional
        Hparams overrides and SpeechBrain run options in one mapping (as ``flwr run
        --run-config`` sends them; hyphens read as underscores).

    Returns
    -------
    tuple
        ``(hparams, run_opts, settings)``.
    """
    from speechbrain_fl.recipe import federated_run_options, split_overrides

    values, run_opts = split_overrides(overrides)
    run_opts = federated_run_options(run_opts)
    path = Path(hparams_path or "hparams/kws.yaml")
    if not path.is_file() and (RECIPE_DIR.parents[1] / path).is_file():
        path = RECIPE_DIR.parents[1] / path  # relative to the app (repository) root
    hparams, _, _ = load_hparams(path, values, run_opts)
    os.makedirs(hparams["output_folder"], exist_ok=True)
    return hparams, run_opts, prepare_settings(hparams, run_opts)


def superb_task(hparams_path=None, overrides=None):
    """The recipe's task factory: ``superb_task(hparams, overrides) -> FLTask``.

    Both engines load it through a :class:`~speechbrain_fl.fl.task.TaskSpec`:
    ``train_fl.py`` hands ``recipes/SUPERB/superb_task.py:superb_task`` to the Simulation
    Engine (each Ray actor loads the factory itself), and ``flwr run`` names it in the run
    config (``task = "recipes/SUPERB/superb_task.py:superb_task"``, ``hparams =
    "hparams/kws.yaml"``, ``overrides = "{...}"``). Preparation runs once per run
    (:func:`prepare_settings`). When the rounds end, ``on_result`` evaluates every trained exit
    on the test split and writes ``results.json``, ``test_predictions.csv`` and the plots in
    the ServerApp's process (:func:`report_run`), on either engine.

    Arguments
    ---------
    hparams_path : str, optional
        A task file; default ``hparams/kws.yaml``.
    overrides : dict, optional
        See :func:`setup_run`.

    Returns
    -------
    FLTask
        ``info`` holds ``hparams`` and ``settings``, and ``results`` once the run has ended.
    """
    start = time.time()
    hparams, _, settings = setup_run(hparams_path, overrides)
    if hparams["scenario"] == "centralized":
        raise ValueError("scenario: centralized has no federated task; run train_fl.py")
    info = {"hparams": hparams, "settings": settings}
    return _fl_task(settings, hparams, info=info, start=start)


def _fl_task(settings, hparams, *, info, start):
    from speechbrain_fl.fl.task import FLTask

    return FLTask(
        build_client=functools.partial(build_client, settings=settings),
        build_server=functools.partial(
            build_server, settings=settings, fl_config=fl_config(hparams)
        ),
        num_partitions=len(settings["clients"]),
        on_result=functools.partial(
            _on_result, settings=settings, hparams=hparams, info=info, start=start
        ),
        info=info,
    )


def _on_result(result, *, settings, hparams, info, start):
    """The rounds ended (in the ServerApp's process): evaluate, write the run's outputs."""
    timings = dict(settings["timings"], training=time.time() - start)
    info["results"] = report_run(settings, hparams, result, timings=timings, start=start)


# ##########################################################################################
# Scenarios
# ##########################################################################################
TASK = f"{Path(__file__).resolve()}:superb_task"


def run_federated(spec, hparams):
    """Heterogeneous / homogeneous: the spec's rounds on Flower's Simulation Engine (Ray).

    ``spec`` is a :class:`~speechbrain_fl.fl.task.TaskSpec` of :func:`superb_task`; the actors
    load the factory themselves. Returns the task's results (``results.json``'s content).
    """
    from speechbrain_fl.fl.engine import run_simulation
    from speechbrain_fl.fl.task import load_task

    if hparams["engine"] != "simulation":
        raise ValueError(
            f"engine: {hparams['engine']!r}: train_fl.py drives the Simulation Engine; for the "
            "Deployment Engine use `flwr run` with task = "
            '"recipes/SUPERB/superb_task.py:superb_task" (README)'
        )
    run_simulation(
        spec,
        client_resources={
            "num_cpus": hparams["num_cpus_per_client"],
            "num_gpus": hparams["num_gpus_per_client"],
        },
        ray_address=hparams["ray_address"],
    )
    return load_task(spec).info["results"]


def run_centralized(settings, hparams):
    """Centralized upper bound: all clients' data pooled, ``centralized_epochs`` at one exit.

    Writes ``rounds.csv`` with one row per epoch (``round`` = epoch) so the plots and the
    results table read it like a federated run.
    """
    from speechbrain_fl.fl.params import trainable_parameters

    depth = settings["eval_exits"][0]
    brain = build_brain(settings, depth=depth)
    pooled = os.path.join(hparams["save_folder"], "centralized_train.csv")
    _concat_csv(settings["clients"], pooled)
    train = make_dataset(pooled, settings["data_folder"], **settings["data_kw"])
    valid = make_dataset(settings["valid_csv"], settings["data_folder"], **settings["data_kw"])
    path = os.path.join(hparams["output_folder"], "rounds.csv")
    rows = [{"round": 0, **evaluate_exits(brain, valid, settings)}]
    for epoch in range(1, hparams["centralized_epochs"] + 1):
        brain.fit(
            [epoch],
            train,
            progressbar=False,
            train_loader_kwargs=dict(settings["hparams"]["dataloader_options"]),
        )
        rows.append({"round": epoch, **evaluate_exits(brain, valid, settings)})
        logger.info("centralized epoch %d: %s", epoch, rows[-1])
    with atomic_open(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    class Result:
        params = {n: p.detach().clone() for n, p in trainable_parameters(brain.modules).items()}
        epsilon = None
        last_round = hparams["centralized_epochs"]

    return Result()


def _concat_csv(paths, out):
    rows, header = [], None
    for path in paths:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = header or reader.fieldnames
            rows.extend(reader)
    with atomic_open(out, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


# ##########################################################################################
# Test evaluation and results
# ##########################################################################################
def evaluate_test(brain, settings, hparams):
    """Per exit: the task metric with a 95% bootstrap CI (speaker- or utterance-level)."""
    from speechbrain_fl.metrics.classification import bootstrap_classification

    spec = TASKS[hparams["task"]]
    test = make_dataset(settings["test_csv"], settings["data_folder"], **settings["data_kw"])
    brain.evaluate(
        test,
        progressbar=True,
        test_loader_kwargs=dict(settings["hparams"]["eval_dataloader_options"]),
    )
    out, rows = {}, []
    if spec["head"] == "ctc":
        from speechbrain_fl.metrics import bootstrap_details, utterance_errors_from_stats

        speakers = {}
        with open(settings["test_csv"], newline="", encoding="utf-8") as handle:
            speakers = {r["ID"]: r["spk_id"] for r in csv.DictReader(handle)}
        for e in brain.eval_exits:
            details = utterance_errors_from_stats(brain.wer[e], speaker_of=speakers)
            wer = bootstrap_details(
                details, num_resamples=hparams["bootstrap_resamples"], seed=hparams["seed"]
            )
            out[str(e)] = {"WER": wer.wer, "ci95": [wer.ci_low, wer.ci_high]}
        return out, rows
    ids, speakers, labels = zip(*brain.records, strict=True)
    units = speakers if spec["bootstrap_unit"] == "speaker" else ids
    for e in brain.eval_exits:
        stats = bootstrap_classification(
            speakers=list(units),
            labels=list(labels),
            predictions=brain.predictions[e],
            num_resamples=hparams["bootstrap_resamples"],
            seed=hparams["seed"],
        )
        out[str(e)] = {"accuracy": stats["accuracy"]["value"], "ci95": stats["accuracy"]["ci"]}
    for i, (uid, spk, label) in enumerate(brain.records):
        row = {"ID": uid, "spk_id": spk, "label": settings["labels"][label]}
        row.update(
            {f"pred_{e}": settings["labels"][brain.predictions[e][i]] for e in brain.eval_exits}
        )
        rows.append(row)
    return out, rows


def memory_by_exit(settings, hparams):
    """Peak training memory (MiB) per trained exit for this task's batch shape.

    Returns ``(peak, step)``: ``peak`` is CUDA ``max_memory_allocated`` or, on CPU, the peak RSS
    of a fresh process per exit (interpreter and all weights included); ``step`` is what the
    training step raised the peak (see ``speechbrain_fl/models/exit_memory.py``).
    """
    if not hparams["measure_memory"]:
        return {}, {}
    from speechbrain_fl.models.exit_memory import peak_training_memory

    options = settings["model"]
    peak, step = {}, {}
    for e in settings["eval_exits"]:
        m = peak_training_memory(
            options["source"],
            depth=e,
            batch_size=hparams["batch_size"],
            seconds=TASKS[hparams["task"]]["seconds"],
            head=options["head"],
            num_outputs=options["num_outputs"],
            freeze_feature_encoder=options["freeze_feature_encoder"],
            device=(settings["run_opts"].get("device") or "cpu"),
        )
        peak[str(e)], step[str(e)] = m["peak_mb"], m["step_mb"]
    return peak, step


def format_table(results):
    """The end-of-run results table (text)."""
    metric = "WER" if results["task"] == "asr" else "accuracy"
    lines = [
        f"SUPERB {results['task']} | scenario {results['scenario']} | aggregation "
        f"{results['aggregation']} ({results['weighting']}) | model {results['checkpoint']}",
        f"{'exit':>5} | {metric:>9} | {'95% CI':>17} | {'memory MB':>9} | {'step MB':>7}"
        + (" | EER    | minDCF" if "asv" in results else ""),
    ]
    for e, entry in results["test"].items():
        lo, hi = entry["ci95"]
        mem = results["memory_mb"].get(e)
        line = (
            f"{e:>5} | {entry[metric]:9.4f} | [{lo:.4f}, {hi:.4f}] | "
            f"{mem if mem is None else round(mem, 1)!s:>9} | "
            f"{results['memory_step_mb'].get(e, '-')!s:>7}"
        )
        if "asv" in results:
            asv = results["asv"][e]
            line += f" | {asv['EER']:.4f} | {asv['minDCF']:.4f}"
        lines.append(line)
    return "\n".join(lines)


def write_plots(folder):
    """Metric by round per exit (from rounds.csv)."""
    from speechbrain_fl.plots import plot_metrics
    from speechbrain_fl.run_outputs import read_table

    rounds = read_table(os.path.join(folder, "rounds.csv"))
    columns = [c for c in rounds if c.startswith(("acc_", "wer_"))]
    if not columns:
        return []
    (Path(folder) / "plots").mkdir(parents=True, exist_ok=True)
    return [plot_metrics(rounds, Path(folder) / "plots" / "metric_by_round.png", columns)]


def report_run(settings, hparams, result, *, timings, start):
    """Evaluate the final model at every trained exit and write the run's outputs.

    ``results.json`` (the schema in the README), ``test_predictions.csv``, the plots and, for
    ASV, the trial scores; prints the results table. ``result`` is the engine's
    :class:`~speechbrain_fl.fl.server.ServerResult` or the centralized run's equivalent
    (``params`` and ``last_round``). Returns the results mapping.
    """
    from speechbrain_fl.fl.params import load_trainable

    timings = dict(timings)
    brain = build_brain(settings)
    load_trainable(brain.modules, result.params)
    t0 = time.time()
    test, rows = evaluate_test(brain, settings, hparams)
    extra = {}
    if hparams["task"] == "asv":
        from superb_data import score_asv

        extra["asv"] = score_asv(brain, settings, hparams)
    timings["evaluation"] = time.time() - t0
    if rows:
        with atomic_open(
            os.path.join(hparams["output_folder"], "test_predictions.csv"), newline=""
        ) as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    t0 = time.time()
    memory, memory_step = memory_by_exit(settings, hparams)
    timings["memory"] = time.time() - t0
    timings["total"] = time.time() - start
    results = {
        "task": hparams["task"],
        "scenario": hparams["scenario"],
        "aggregation": hparams["aggregation"],
        "weighting": hparams["weighting"],
        "checkpoint": str(hparams["model"]),
        "checkpoint_source": settings["model"]["source"],
        "test": test,
        "memory_mb": memory,
        "memory_step_mb": {k: round(v, 1) for k, v in memory_step.items()},
        **extra,
        "depths": settings["depths"],
        "depth_decisions": settings.get("depth_decisions"),
        "num_clients": len(settings["clients"]),
        "rounds": result.last_round,
        "seed": hparams["seed"],
        "freeze_feature_encoder": hparams["freeze_feature_encoder"],
        "embedded_corpus": hparams["data_folder"] is None,
        "bootstrap_unit": TASKS[hparams["task"]]["bootstrap_unit"],
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    with atomic_open(os.path.join(hparams["output_folder"], "results.json")) as handle:
        json.dump(results, handle, indent=2, default=float)
    plots = write_plots(hparams["output_folder"])
    hparams["train_logger"].log_stats(
        stats_meta={"round": result.last_round, "scenario": hparams["scenario"]},
        test_stats={f"exit_{e}": next(iter(v.values())) for e, v in test.items()},
    )
    print("\n" + format_table(results))
    print("Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings_s"].items()))
    print(
        f"Results: {os.path.join(hparams['output_folder'], 'results.json')}; "
        f"{len(plots)} plot(s) in {os.path.join(hparams['output_folder'], 'plots')}"
    )
    return results

"""The SUPERB federated task: Brain, model, ClientApp/ServerApp builders, the task factory.

``superb_task(hparams, overrides) -> FLTask`` is the recipe's task factory. Both engines reach
it through a :class:`~speechbrain_fl.fl.task.TaskSpec` naming this file
(``recipes/SUPERB/superb_task.py:superb_task``): ``train_fl.py`` hands the spec to the
Simulation Engine, whose Ray actors load the factory themselves, and ``flwr run`` names it in
the run config. It lives in its own module (not in ``train_fl.py``, which runs as
``__main__``) so every process imports the same module once and keeps one model per process.

The recipe's other jobs, one module each: the tasks, their data pipeline and the seed model
(``superb_data.py``), the checks and the typed settings (``superb_settings.py``), the report
(``superb_report.py``); the optimiser groups and lr schedule are
:mod:`speechbrain_fl.models.multi_exit_optim`; the frame (loading,
``--debug``, prepare once, the simulation run) is :class:`speechbrain_fl.recipe.FederatedRecipe`.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import speechbrain as sb
import torch

from speechbrain_fl.models.multi_exit_optim import balanced_sampler, build_optimizer

RECIPE_DIR = Path(__file__).resolve().parent
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

from superb_data import (  # noqa: E402, F401 (make_dataset, decode/encode: the recipe's API)
    CTC_ALPHABET,
    debug_corpus_options,
    decode_chars,
    encode_chars,
    make_dataset,
)
from superb_report import report_run  # noqa: E402
from superb_settings import (  # noqa: E402, F401 (re-exported: the recipe's API)
    SCENARIOS,
    SuperbSettings,
    apply_memory_budgets,
    budget_cache_key,
    budget_depth,
    budget_settings_for,
    check_hparams,
    client_depths,
    default_rounds,
    fl_config,
    make_settings,
    trained_exits,
)

from speechbrain_fl.fl.clientapp.train import ClientTask  # noqa: E402
from speechbrain_fl.fl.params import trainable_parameters  # noqa: E402
from speechbrain_fl.fl.serverapp.task import ServerTask  # noqa: E402
from speechbrain_fl.recipe import FederatedRecipe, ModelCache, write_rows  # noqa: E402

logger = logging.getLogger(__name__)

TASK = f"{Path(__file__).resolve()}:superb_task"


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
                    self.accuracy[e].append(out.unsqueeze(0), target.unsqueeze(0))
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
        """``opt_class`` (backbone and heads in their own groups) at this round's lr.

        Federated: the client's lr in round t of T is the peak times ``lr_annealing(t, T)``
        (:class:`~speechbrain_fl.models.multi_exit_optim.WarmupCosine`: warmup, cosine over
        rounds; the engine sets ``fl_round`` / ``fl_num_rounds`` before each local training).
        Centralized (``total_steps`` set): the same schedule per optimiser step, by a
        ``LambdaLR`` stepped after every batch; optimiser and scheduler are registered with the
        checkpointer, so a resumed run continues both.
        """
        hp = self.hparams
        schedule = hp.lr_annealing
        groups = {
            "opt_class": hp.opt_class,
            "lr": hp.lr,
            "backbone_lr_multiplier": hp.backbone_lr_multiplier,
        }
        total_steps = getattr(self, "total_steps", None)
        if total_steps:
            self.optimizer = build_optimizer(self.modules.model, **groups)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda done: schedule(done + 1, total_steps)
            )
        else:
            factor = schedule(getattr(self, "fl_round", 1), getattr(self, "fl_num_rounds", 1))
            self.optimizer = build_optimizer(self.modules.model, factor=factor, **groups)
            self.scheduler = None
        self.optimizers_dict = {"optimizer": self.optimizer}
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("optimizer", self.optimizer)
            if self.scheduler is not None:
                self.checkpointer.add_recoverable("scheduler", self.scheduler)

    def on_fit_batch_end(self, batch, outputs, loss, should_step):
        """Step the centralized run's per-step scheduler."""
        if should_step and getattr(self, "scheduler", None) is not None:
            self.scheduler.step()

    def on_stage_start(self, stage, epoch=None):
        """Fresh per-exit accumulators for evaluation stages."""
        if stage != sb.Stage.TRAIN:
            self.predictions = {e: [] for e in self.eval_exits}
            self.records = []
            self.wer = {e: self.hparams.error_stats() for e in self.eval_exits}
            self.accuracy = {e: self.hparams.accuracy_stats() for e in self.eval_exits}

    def on_stage_end(self, stage, stage_loss, epoch=None):
        """Store the stage's metrics per exit in ``last_stats``."""
        stats = {"loss": stage_loss}
        if stage == sb.Stage.TRAIN:
            self.epoch_train_loss = float(stage_loss)
        if stage != sb.Stage.TRAIN:
            for e in self.eval_exits:
                if self.modules.model.head_type == "ctc":
                    stats[f"wer_{e}"] = self.wer[e].summarize("error_rate") / 100.0
                else:
                    stats[f"acc_{e}"] = float(self.accuracy[e].summarize())
        self.last_stats = stats
        history = getattr(self, "history", None)
        if history is not None and stage == sb.Stage.VALID:
            # the centralized run: one rounds.csv row per epoch, then a checkpoint of the
            # model, optimiser, scheduler, epoch counter and these rows
            history.rows.append({"round": epoch, **{k: v for k, v in stats.items() if k != "loss"}})
            history.rows[-1]["train_loss"] = getattr(self, "epoch_train_loss", float("nan"))
            logger.info("centralized epoch %d: %s", epoch, history.rows[-1])
            if self.checkpointer is not None:
                self.checkpointer.save_and_keep_only(meta={"epoch": epoch}, num_to_keep=1)


# ##########################################################################################
# Model and Brain construction (one model per process)
# ##########################################################################################
_MODELS = ModelCache()


def new_model(options, factory):
    """A fresh multi-exit model: ``factory`` (the hparams' ``model_factory``) on ``options``.

    ``options`` are the recipe's model options (``settings.model``). :func:`build_model`
    caches the model per process; ``studies/deep_exit_probe.py`` builds its own variants
    (another seed, ``config_overrides``) through here so both read the options the same way.
    """
    return factory(
        options["source"],
        num_outputs=options["num_outputs"],
        cache_dir=options["cache_dir"],
        exits=options["exits"],
        head=options["head"],
        freeze_feature_encoder=options["freeze_feature_encoder"],
        seed=options["seed"],
        config_overrides=options.get("config_overrides"),
        normalize_input=options.get("normalize_input", "auto"),
        pooling=options.get("pooling", "stat"),
        upstream=options.get("upstream", "finetune"),
    )


def build_model(settings, factory):
    """The multi-exit model from the seed folder (one per process, :class:`ModelCache`)."""
    options = settings.model
    return _MODELS.get(options, lambda: new_model(options, factory).to(settings.device))


def build_brain(settings, hparams, *, depth=None, checkpointer=None):
    """A SuperbBrain training exit ``depth`` and evaluating ``settings.eval_exits``.

    ``settings`` is a :class:`SuperbSettings` (or a mapping of its fields); ``hparams`` the
    run's loaded hparams, whose objects (``model_factory``, ``opt_class``, ``lr_annealing``,
    ``error_stats``, ``accuracy_stats``) the Brain uses.
    """
    settings = SuperbSettings.coerce(settings)
    brain = SuperbBrain(
        modules={"model": build_model(settings, hparams["model_factory"])},
        hparams=hparams,
        run_opts=dict(settings.run_opts),
        checkpointer=checkpointer,
    )
    brain.depth = int(depth or max(settings.eval_exits))
    brain.eval_exits = tuple(settings.eval_exits)
    return brain


def _reply_partial(brain):
    """The tensors a client trained (layers <= depth, its exit head, below) and its depth."""
    return brain.modules.model.trained_parameter_names(brain.depth, prefix="model."), {
        "exit-depth": brain.depth
    }


# ##########################################################################################
# Federated task (Flower ClientApp / ServerApp builders)
# ##########################################################################################
def build_client(context, *, settings, hparams):
    """ClientApp builder: this partition's Brain (at its exit) and training set."""
    partition_id = int(context.node_config["partition-id"])
    torch.set_num_threads(max(1, min(int(settings.cpus_per_client), settings.num_threads)))
    brain = build_brain(settings, hparams, depth=settings.depths[partition_id])
    budget = settings.budgets[partition_id] if settings.budgets else None
    if budget is not None:
        brain.depth_rule = functools.partial(
            budget_depth, budget_mb=budget, budget_settings=settings.budget_settings
        )
    manifest = settings.clients[partition_id]
    return ClientTask(
        brain=brain,
        train_set=make_dataset(
            manifest, settings.data_folder, skip_unreadable=True, **settings.data_kw
        ),
        train_loader_kwargs=train_loader_kwargs(hparams, manifest),
        partial=_reply_partial,
    )


def train_loader_kwargs(hparams, manifest):
    """``dataloader_options``, with a class-balanced sampler if ``balanced_sampling``."""
    kwargs = dict(hparams["dataloader_options"])
    if hparams["balanced_sampling"]:
        kwargs.update(shuffle=False, sampler=balanced_sampler(manifest))
    return kwargs


def evaluate_exits(brain, dataset):
    """Validation metrics per evaluated exit (``acc_<e>`` or ``wer_<e>``)."""
    brain.evaluate(
        dataset,
        progressbar=False,
        test_loader_kwargs=dict(brain.hparams.eval_dataloader_options),
    )
    return {k: float(v) for k, v in brain.last_stats.items() if k != "loss"}


def build_server(context, *, settings, hparams, fl_config):
    """ServerApp builder: the global model, the config and per-exit validation."""
    brain = build_brain(settings, hparams)
    valid_set = make_dataset(settings.valid_csv, settings.data_folder, **settings.data_kw)
    return ServerTask(
        brain=brain,
        config=fl_config,
        evaluate=functools.partial(evaluate_exits, dataset=valid_set),
        min_available_nodes=settings.num_clients,
        num_partitions=settings.num_clients,
        partition_sizes=settings.partition_sizes(),
    )


# ##########################################################################################
# The task factory
# ##########################################################################################
RECIPE = FederatedRecipe(
    recipe_dir=RECIPE_DIR,
    task_ref=TASK,
    default_hparams="hparams/kws35.yaml",
    check=check_hparams,
    defaults=default_rounds,
    # --debug: tiny sizes, seconds to run: 2 clients, 2 rounds, a few generated clips per task
    # (in <cache_folder>_debug, its own cache); outputs go to <output_folder>_debug
    debug_caps={
        "number_of_rounds": 2,
        "pretrain_steps": 2,
        "centralized_epochs": 2,
        "bootstrap_resamples": 200,
        "num_clients": 2,
        "public_corpus_options": {"splits": {"public": 2}, "utterances_per_speaker": 2},
        "phone_corpus": {"speakers": 1, "utterances": 2},
        "corpus_options": debug_corpus_options,
    },
    debug_values={"measure_memory": False},
)


def load_hparams(hparams_file, overrides=None, run_opts=None):
    """Layered hparams (task file on base.yaml), defaults, debug sizes applied, checked.

    Returns ``(hparams, base_file, merged_overrides)``.
    """
    hparams, _, base_file, merged = RECIPE.load(hparams_file, overrides, run_opts)
    return hparams, base_file, merged


# Preparation keys: every hparams value that is plain data (numbers, strings, lists,
# mappings); objects (the train logger) are left out. A change of any of them prepares again
# (the corpus and the seed model are cached on disk, so that is cheap).
_PLAIN = (str, int, float, bool, type(None), list, dict)


def prepare_settings(hparams, run_opts):
    """:func:`superb_settings.make_settings` once per run, as :class:`SuperbSettings`.

    The first process of a run (the script, or the ServerApp of ``flwr run``) prepares the data
    and the seed model and writes ``<save_folder>/prepared.json``; the others (Ray actors,
    SuperNodes, ClientApps) read it, so no process rewrites a file another one is reading.
    """
    key = {k: v for k, v in hparams.items() if isinstance(v, _PLAIN) and not k.startswith("__")}
    prepared = RECIPE.prepare(
        hparams, run_opts, key=key, make=lambda: make_settings(hparams, run_opts)
    )
    return SuperbSettings.from_dict(prepared)


def setup_run(hparams_path, overrides=None):
    """Hparams, run options and prepared settings of a run, from one overrides mapping.

    ``hparams_path`` resolves against the working directory, this folder, then the repository
    root; ``overrides`` holds hparams overrides and SpeechBrain run options in one mapping (as
    ``flwr run --run-config`` sends them). Returns ``(hparams, run_opts, settings)``.
    """
    hparams, run_opts, _ = RECIPE.load_for_task(hparams_path, overrides)
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
    the ServerApp's process (:func:`superb_report.report_run`), on either engine.

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
    return RECIPE.task(
        settings,
        build_client=functools.partial(build_client, hparams=hparams),
        build_server=build_server,
        hparams=hparams,
        fl_config=fl_config(hparams),
        on_result=functools.partial(
            _on_result, settings=settings, hparams=hparams, info=info, start=start
        ),
        info=info,
        train_logger=hparams["train_logger"],  # the round lines go through it
    )


def report(settings, hparams, result, *, timings, start):
    """:func:`superb_report.report_run` with this process's Brain and the test split."""
    test_set = make_dataset(settings.test_csv, settings.data_folder, **settings.data_kw)
    return report_run(
        settings, hparams, result, brain=build_brain(settings, hparams), test_set=test_set,
        timings=timings, start=start,
    )  # fmt: skip


def _on_result(result, *, settings, hparams, info, start):
    """The rounds ended (in the ServerApp's process): evaluate, write the run's outputs."""
    timings = dict(settings.timings, training=time.time() - start)
    info["results"] = report(settings, hparams, result, timings=timings, start=start)


# ##########################################################################################
# Scenarios
# ##########################################################################################
def run_federated(spec, hparams):
    """Heterogeneous / homogeneous: the spec's rounds on Flower's Simulation Engine.

    ``spec`` is a :class:`~speechbrain_fl.fl.task.TaskSpec` of :func:`superb_task`; the actors
    load the factory themselves. Returns the task's results (``results.json``'s content).
    """
    from speechbrain_fl.fl.task import load_task

    RECIPE.simulate(spec, hparams)
    return load_task(spec).info["results"]


def run_centralized(settings, hparams):
    """Centralized upper bound: all clients' data pooled, ``centralized_epochs`` at one exit.

    One ``fit`` over an :class:`~speechbrain.utils.epoch_loop.EpochCounter`: one optimiser and
    one per-step lr schedule (warmup, cosine;
    :func:`~speechbrain_fl.models.multi_exit_optim.lr_factor`) for the whole run, validated after every epoch. A checkpoint (model, optimiser, scheduler, epoch counter,
    the rows so far) is kept in ``<save_folder>/centralized``, so an interrupted run resumes
    where it stopped. Writes ``rounds.csv`` with one row per epoch (``round`` = epoch) so the
    plots and the results table read it like a federated run.
    """
    from speechbrain.utils.checkpoints import Checkpointer
    from speechbrain.utils.epoch_loop import EpochCounter

    depth = settings.eval_exits[0]
    epochs = int(hparams["centralized_epochs"])
    pooled = os.path.join(hparams["save_folder"], "centralized_train.csv")
    _concat_csv(settings.clients, pooled)
    train = make_dataset(pooled, settings.data_folder, **settings.data_kw)
    valid = make_dataset(settings.valid_csv, settings.data_folder, **settings.data_kw)
    counter = EpochCounter(epochs)
    history = RowLog()
    checkpointer = Checkpointer(
        os.path.join(hparams["save_folder"], "centralized"),
        recoverables={"counter": counter, "history": history},
    )
    brain = build_brain(settings, hparams, depth=depth, checkpointer=checkpointer)
    checkpointer.add_recoverable("model", brain.modules)
    loader_kwargs = train_loader_kwargs(hparams, pooled)
    batch_size = int(loader_kwargs.get("batch_size", 1))
    brain.total_steps = epochs * -(-len(train) // batch_size)
    brain.history = history
    if not checkpointer.find_checkpoints():
        history.rows.append({"round": 0, **evaluate_exits(brain, valid), "train_loss": ""})
    brain.fit(
        counter,
        train,
        valid,
        progressbar=False,
        train_loader_kwargs=loader_kwargs,
        valid_loader_kwargs=dict(hparams["eval_dataloader_options"]),
    )
    write_rows(os.path.join(hparams["output_folder"], "rounds.csv"), history.rows)

    class Result:
        params = {n: p.detach().clone() for n, p in trainable_parameters(brain.modules).items()}
        epsilon = None
        last_round = epochs

    return Result()


@sb.utils.checkpoints.register_checkpoint_hooks
class RowLog:
    """The centralized run's per-epoch rows, saved with its checkpoint (resume keeps them)."""

    def __init__(self):
        self.rows = []

    @sb.utils.checkpoints.mark_as_saver
    def _save(self, path):
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.rows, handle)

    @sb.utils.checkpoints.mark_as_loader
    def _load(self, path, end_of_epoch=False):
        del end_of_epoch
        with open(path, encoding="utf-8") as handle:
            self.rows = json.load(handle)


def _concat_csv(paths, out):
    rows, header = [], None
    for path in paths:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = header or reader.fieldnames
            rows.extend(reader)
    write_rows(out, rows, header)

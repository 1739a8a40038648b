"""The SUPERB recipe's run settings: checks, client depths, memory budgets, the prepared run.

- :func:`check_hparams`: every value check, before any work (the engine config included);
- :func:`client_depths`, :func:`trained_exits`: L_max per client and the exits reported;
- the ``memory_budget`` depth policy (ours): :func:`apply_memory_budgets` and its helpers;
- :func:`fl_config`: the engine config through the shared YAML vocabulary;
- :class:`SuperbSettings` and :func:`make_settings`: the typed prepared run the builders read.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from superb_data import CTC_ALPHABET, TASKS, check_task, prepare_task, seed_model_folder

from speechbrain_fl.privacy.methods import method_name
from speechbrain_fl.recipe import RunSettings

logger = logging.getLogger("superb_task")

SCENARIOS = ("centralized", "homogeneous", "heterogeneous")
#: hparams keys passed to ``Wav2Vec2Config`` at load time (LayerDrop, SpecAugment's time masks)
CONFIG_KEYS = ("layerdrop", "mask_time_prob", "mask_time_length", "mask_time_min_masks")
SHALLOW_CLIENTS = ("train", "drop")


@dataclass
class SuperbSettings(RunSettings):
    """:class:`~speechbrain_fl.recipe.RunSettings` plus what the SUPERB builders read.

    Arguments
    ---------
    labels : list of str
        The task's classes (empty for ASR).
    data_kw : dict
        :func:`superb_data.make_dataset`'s keyword arguments (``labels`` or ``ctc``).
    extra : dict
        The preparation's report.
    num_threads : int
        Intra-op threads of a process.
    depths : list of int
        L_max per client (partition order).
    budgets : list of float, optional
        Declared memory budgets (MB) per client (``depth_policy: memory_budget``).
    budget_settings : dict, optional
        What the budget rule measures with (:func:`budget_settings_for`).
    depth_decisions : list of dict, optional
        The budget policy's decision per client (logged, kept in results.json).
    eval_exits : list of int
        The exits trained and reported.
    """

    labels: list[str] = field(default_factory=list)
    data_kw: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    num_threads: int = 1
    depths: list[int] = field(default_factory=list)
    budgets: list[float] | None = None
    budget_settings: dict[str, Any] | None = None
    depth_decisions: list[dict[str, Any]] | None = None
    eval_exits: list[int] = field(default_factory=lambda: [12])

    @classmethod
    def coerce(cls, settings) -> SuperbSettings:
        """``settings`` itself, or :class:`SuperbSettings` from a mapping of its fields."""
        return settings if isinstance(settings, cls) else cls.from_dict(dict(settings))


def check_hparams(hparams):
    """Fail fast, before anything heavy, on a task, scenario, exit or rule the run cannot use.

    Runs in :meth:`speechbrain_fl.recipe.FederatedRecipe.load`, before corpus synthesis,
    features or pretraining; builds the engine's FLConfig (:func:`fl_config`) so its checks
    run up front too.
    """
    from speechbrain_fl.fl.aggregate.layerwise import rule_name

    check_task(hparams["task"])
    if hparams["scenario"] not in SCENARIOS:
        raise ValueError(f"scenario: {hparams['scenario']!r} must be one of {list(SCENARIOS)}")
    exits = [int(e) for e in hparams["exits"]]
    for key in ("exit", "best_exit", "shallow_exit"):
        value = hparams[key]
        if value is not None and int(value) not in exits:
            raise ValueError(f"{key}: {value!r} is not one of the exits {exits}")
    rule_name(hparams["aggregation"], hparams["weighting"])
    momentum, server_lr = hparams.get("server_momentum", 0.0), hparams.get("server_lr", 1.0)
    if not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"server_momentum: {momentum!r} must be a number in [0, 1)")
    if not isinstance(server_lr, (int, float)) or not server_lr > 0.0:
        raise ValueError(f"server_lr: {server_lr!r} must be a number > 0")
    session = hparams.get("test_session", 5)
    if isinstance(session, bool) or not isinstance(session, int) or session < 1:
        raise ValueError(
            f"test_session: {session!r} must be an IEMOCAP session number >= 1 (1-5 on the "
            "real corpus; studies/er_folds.py runs all five)"
        )
    if method_name(hparams.get("method", "fedavg")) != "fedavg":
        raise ValueError(
            f"method: {method_name(hparams['method'])!r}: the SUPERB recipe runs without clipping "
            "(method: fedavg); clipping partial (layer-wise) replies is not implemented"
        )
    if hparams["noise_multiplier"] > 0:
        from speechbrain_fl.fl.aggregate.rules import get_rule

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
    if hparams["depth_policy"] == "memory_budget" and not hparams["client_memory_budgets_mb"]:
        raise ValueError("depth_policy: memory_budget needs client_memory_budgets_mb (a list)")
    if hparams["scenario"] == "heterogeneous" and hparams["depth_policy"] == "groups":
        deep = int(hparams["exit"] or hparams["best_exit"])
        if int(hparams["shallow_exit"]) >= deep:
            raise ValueError(
                f"shallow_exit: {hparams['shallow_exit']} must be below the deep exit {deep} "
                "(exit, or best_exit) in the heterogeneous scenario"
            )
        k = hparams["num_clients"]
        if isinstance(k, int) and not 1 <= round(hparams["shallow_fraction"] * k) <= k - 1:
            raise ValueError(
                f"num_clients: {k} with shallow_fraction {hparams['shallow_fraction']} leaves "
                "one depth group empty; the heterogeneous scenario needs clients at both exits "
                "(at least 2 clients), or use scenario: homogeneous"
            )
    if hparams["pretrain_objective"] not in ("none", "bag_of_words", "ctc", "phones"):
        raise ValueError(
            f"pretrain_objective: {hparams['pretrain_objective']!r} must be 'none', "
            "'bag_of_words', 'ctc' or 'phones'"
        )
    corpus = hparams["phone_corpus"]
    keys = {"speakers", "utterances", "speaker_offset"}
    if (
        not isinstance(corpus, dict)
        or set(corpus) != keys
        or not all(type(v) is int and v >= int(k != "speaker_offset") for k, v in corpus.items())
    ):
        raise ValueError(
            f"phone_corpus: {corpus!r} must map speakers and utterances to integers >= 1 and "
            "speaker_offset to an integer >= 0"
        )
    pretrain_exits = hparams["pretrain_exits"]
    if (
        not isinstance(pretrain_exits, list | tuple)
        or not pretrain_exits
        or not set(pretrain_exits) <= set(hparams["exits"])
    ):
        raise ValueError(
            f"pretrain_exits: {pretrain_exits!r} must be a non-empty list of exits from "
            f"exits {list(hparams['exits'])}"
        )
    _check_training(hparams)
    # the engine config's own checks (rounds, sampling, timeouts, ...), before any work
    fl_config(hparams)


def _check_training(hparams):
    """The optimiser, schedule, model-option and sampling keys (ours), with the value named."""
    # key: (low, high, high included)
    ranges = {
        "lr_warmup_fraction": (0.0, 1.0, False),
        "lr_min_ratio": (0.0, 1.0, True),
        "layerdrop": (0.0, 1.0, False),
        "mask_time_prob": (0.0, 1.0, True),
    }
    for key, (low, high, closed) in ranges.items():
        value = hparams[key]
        inside = isinstance(value, (int, float)) and (
            low <= value <= high if closed else low <= value < high
        )
        if not inside:
            raise ValueError(
                f"{key}: {value!r} must be a number in [{low}, {high}{']' if closed else ')'}"
            )
    if not (
        isinstance(hparams["backbone_lr_multiplier"], (int, float))
        and hparams["backbone_lr_multiplier"] >= 0
    ):
        raise ValueError(
            f"backbone_lr_multiplier: {hparams['backbone_lr_multiplier']!r} must be a number >= 0"
        )
    for key, low in (("mask_time_length", 1), ("mask_time_min_masks", 0)):
        if not isinstance(hparams[key], int) or hparams[key] < low:
            raise ValueError(f"{key}: {hparams[key]!r} must be an integer >= {low}")
    if hparams["normalize_input"] not in (True, False, "auto"):
        raise ValueError(
            f"normalize_input: {hparams['normalize_input']!r} must be True, False or 'auto'"
        )
    if hparams["pooling"] not in ("stat", "mean"):
        raise ValueError(f"pooling: {hparams['pooling']!r} must be 'stat' or 'mean'")
    if hparams["upstream"] not in ("finetune", "frozen"):
        raise ValueError(f"upstream: {hparams['upstream']!r} must be 'finetune' or 'frozen'")
    if hparams["balanced_sampling"] and TASKS[hparams["task"]]["head"] == "ctc":
        raise ValueError("balanced_sampling: True needs a classification task; asr has no classes")
    if hparams["shallow_clients"] not in SHALLOW_CLIENTS:
        raise ValueError(
            f"shallow_clients: {hparams['shallow_clients']!r} must be one of {list(SHALLOW_CLIENTS)}"
        )
    if hparams["shallow_clients"] == "drop" and (
        hparams["scenario"] != "heterogeneous" or hparams["depth_policy"] != "groups"
    ):
        raise ValueError(
            "shallow_clients: drop (the deep-clients-only baseline) needs scenario: "
            "heterogeneous with depth_policy: groups"
        )


def trained_exits(hparams):
    """The exits a scenario trains (and reports).

    Heterogeneous with ``shallow_clients: drop`` (the deep-clients-only baseline) trains the
    deep exit only.
    """
    deep = int(hparams["exit"] or hparams["best_exit"])
    if hparams["scenario"] == "heterogeneous" and hparams.get("shallow_clients") == "drop":
        return [deep]
    if hparams["scenario"] == "heterogeneous":
        return sorted({int(hparams["shallow_exit"]), deep})
    return [deep]


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
    settings["clients"], settings["depths"], settings["budgets"] = clients, depths, kept_budgets
    settings["eval_exits"] = sorted(set(depths))
    return decisions


def fl_config(hparams):
    """The engine's FLConfig from the recipe's hparams, through the shared YAML vocabulary.

    :meth:`speechbrain_fl.fl.settings.config.FLConfig.from_hparams` reads ``number_of_rounds``,
    ``method``, ``sampling_rate``, ``noise_multiplier``, ... like every recipe's. The one
    SUPERB difference: its ``aggregation`` (``layerwise`` | ``fedavg_full``) and ``weighting``
    keys name a registered rule of :mod:`speechbrain_fl.fl.aggregate.layerwise`, passed as the config's
    ``aggregation`` field; with ``server_momentum`` > 0 (or ``server_lr`` != 1) the rule is
    wrapped in :class:`~speechbrain_fl.fl.aggregate.layerwise.ServerMomentum` (FedAvgM on its delta),
    a fresh one per call (its buffers belong to one run).

    Example
    -------
    >>> cfg = fl_config({"output_folder": "o", "number_of_rounds": 3, "method": "fedavg",
    ...     "aggregation": "layerwise", "weighting": "samples", "noise_multiplier": 0.0})
    >>> cfg.num_rounds, cfg.aggregation, cfg.private
    (3, 'layerwise_samples', False)
    """
    from speechbrain_fl.fl.aggregate.layerwise import ServerMomentum, rule_name
    from speechbrain_fl.fl.aggregate.rules import get_rule
    from speechbrain_fl.fl.settings.config import FLConfig

    rule = rule_name(hparams["aggregation"], hparams["weighting"])
    momentum = float(hparams.get("server_momentum", 0.0) or 0.0)
    server_lr = float(hparams.get("server_lr", 1.0))
    if momentum or server_lr != 1.0:
        rule = ServerMomentum(get_rule(rule), momentum=momentum, server_lr=server_lr)
    return FLConfig.from_hparams(hparams, aggregation=rule)


def make_settings(hparams, run_opts):
    """Prepare data and the seed model; return the run's :class:`SuperbSettings` as data."""
    timings = {}
    start = time.time()
    data = prepare_task(hparams)
    timings["data"] = time.time() - start
    start = time.time()
    seed_source, info = seed_model_folder(hparams, data["public"])
    timings["seed"] = time.time() - start  # pretraining (info) or loading a shipped seed
    timings.update(info)
    spec = TASKS[hparams["task"]]
    ctc = spec["head"] == "ctc"
    num_clients = len(data["clients"])
    settings = SuperbSettings(
        run_opts={
            k: v
            for k, v in run_opts.items()
            if k in ("device", "precision", "debug", "debug_batches", "debug_epochs")
        }
        | {"noprogressbar": True},
        data_folder=data["data_folder"],
        clients=data["clients"],
        valid_csv=data["valid"],
        test_csv=data["test"],
        labels=data["labels"],
        data_kw={"ctc": True} if ctc else {"labels": data["labels"]},
        extra=data.get("extra", {}),
        cpus_per_client=hparams["num_cpus_per_client"],
        num_threads=int(hparams["num_threads"]),
        depths=client_depths(hparams, num_clients),
        eval_exits=trained_exits(hparams),
        model={
            "source": seed_source,
            "num_outputs": len(CTC_ALPHABET) + 1 if ctc else len(data["labels"]),
            "cache_dir": hparams["cache_folder"],
            "exits": [int(e) for e in hparams["exits"]],
            "head": spec["head"],
            "freeze_feature_encoder": hparams["freeze_feature_encoder"],
            "seed": hparams["seed"],
            "config_overrides": {k: hparams[k] for k in CONFIG_KEYS},
            "normalize_input": hparams["normalize_input"],
            "pooling": hparams["pooling"],
            "upstream": hparams["upstream"],
        },
        timings=timings,
    )
    if hparams["scenario"] == "heterogeneous" and hparams["shallow_clients"] == "drop":
        drop_shallow_clients(settings, int(hparams["shallow_exit"]))
    if hparams["depth_policy"] == "memory_budget":
        settings.depth_decisions = apply_memory_budgets(hparams, settings)
    return settings.to_dict()


def drop_shallow_clients(settings, shallow_exit):
    """The deep-clients-only baseline: the clients of the shallow group are left out.

    They model weak devices a depth-homogeneous federation at the deep exit cannot use; the
    remaining clients keep their partitions (the run trains on less data, which is the point
    of the comparison).
    """
    kept = [i for i, d in enumerate(settings.depths) if d != shallow_exit]
    logger.info(
        "shallow_clients: drop: %d of %d clients (those at exit %d) left out",
        len(settings.depths) - len(kept),
        len(settings.depths),
        shallow_exit,
    )
    settings.clients = [settings.clients[i] for i in kept]
    settings.depths = [settings.depths[i] for i in kept]


def default_rounds(hparams):
    """``number_of_rounds: null``: the embedded default's rounds, or the paper's on real data."""
    if hparams["number_of_rounds"] is None:
        hparams["number_of_rounds"] = (
            hparams["embedded_rounds"]
            if hparams["data_folder"] is None
            else hparams["paper_rounds"]
        )

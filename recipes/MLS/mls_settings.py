"""The MLS recipe's settings: every value check, the model options, the preparation keys.

- :func:`check_hparams`: every value check, before any work (the engine config included);
- :func:`model_options`: the keyword arguments of ``build_speech_llm``;
- :data:`BRAIN_KEYS` / :data:`BRAIN_OBJECTS` / :data:`PREPARATION_KEYS`: the plain values and
  the objects the Brain reads, what shapes a run's preparation (a change of any prepares again; corpus and seed model are cached on disk).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import math
from pathlib import Path

from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.models.presets import CONNECTOR_TREATMENTS, CTC_TREATMENTS, PRESETS
from speechbrain_fl.privacy.layout import GROUPINGS
from speechbrain_fl.privacy.methods import method_name, privacy_method, with_settings


def model_options(hparams):
    """The keyword arguments of ``build_speech_llm``: those of the ``speech_llm`` factory."""
    return dict(hparams["speech_llm"].keywords)


BRAIN_KEYS = (
    "seed",
    "encoder_lr_multiplier",
    "max_new_tokens",
    "num_beams",
    "max_grad_norm",
    "group_by",
    "dataloader_options",
    "eval_dataloader_options",
)
# The Brain's objects of the hparams file (built in each process that loads it, never stored)
BRAIN_OBJECTS = ("opt_class", "lr_schedule", "error_stats")
PREPARATION_KEYS = (
    "data_folder", "cache_folder", "save_folder", "skip_prep", "languages", "max_utts_per_split",
    "corpus_speakers_per_language", "corpus_utterances_per_speaker",
    "corpus_public_speakers_per_language", "corpus_public_utterances_per_speaker",
    "corpus_eval_utterances_per_speaker", "partition", "num_clients", "seed", "model",
    "pretrain_ctc_steps", "pretrain_lm_steps", "pretrain_speech_steps", "pretrain_lr",
    "pretrain_batch_size", "pretrain_max_grad_norm", "connector", "shipped_seed",
    "downsample_k", "ctc_weight", "prompt", "max_grad_norm", "freeze_encoder", "lora_r",
    "lora_alpha", "gradient_checkpointing", "train_llm_lora", "connector_treatment",
    "ctc_treatment", "corpus_client_rate",
    "corpus_client_novel_share", *BRAIN_KEYS,
)  # fmt: skip


def engine_hparams(hparams):
    """The hparams the federated engine is configured from (:class:`FLConfig`).

    One change (ours, following the paper): alpha-split with the encoder frozen. Its encoder
    pool is then empty, and budgets C*sqrt(alpha) / C*sqrt(1 - alpha) would leave alpha*C^2
    unused. The paper's frozen row is Table II's alpha = 0 ("Enc. frozen": the LLM pool gets
    C, 1.020x Flat-e's per-layer budget), and alpha = 0 is alpha-split's LLM pool alone with
    size-proportional budgets: PFL-Dim over the LLM + connector groups, which is what the engine
    runs (``alpha`` None). results.json keeps ``method: alpha_split``; its privacy section
    records the engine's clip method. A method object becomes a
    :class:`~speechbrain_fl.privacy.methods.PFLDim` with its clip and noise.

    Example
    -------
    >>> engine_hparams({"method": "alpha_split", "freeze_encoder": True, "alpha": 0.05})
    {'method': 'pfl_dim', 'freeze_encoder': True, 'alpha': None}
    >>> engine_hparams({"method": "alpha_split", "freeze_encoder": False, "alpha": 0.05})["method"]
    'alpha_split'
    >>> from speechbrain_fl.privacy.methods import AlphaSplit
    >>> engine_hparams({"method": AlphaSplit(clip=1.0, noise_multiplier=0.1, alpha=0.05),
    ...                 "freeze_encoder": True, "alpha": 0.05})["method"]
    PFLDim(clip=1.0, noise_multiplier=0.1)
    """
    method = hparams["method"]
    if method_name(method) == "alpha_split" and hparams["freeze_encoder"]:
        if not isinstance(method, str):  # the object's clip and noise, as PFL-Dim's
            return {**hparams, "method": privacy_method("pfl_dim", **vars(method)), "alpha": None}
        return {**hparams, "method": "pfl_dim", "alpha": None}
    return hparams


def check_hparams(hparams):
    """Fail fast, before any heavy work, on values the run cannot use."""
    model = hparams["model"]
    if model not in PRESETS and not (Path(str(model)) / "speech_llm.json").is_file():
        raise ValueError(
            f"model: {model!r} is neither a preset {sorted(PRESETS)} nor a folder with "
            "speech_llm.json"
        )
    for key, allowed in (
        ("connector_treatment", CONNECTOR_TREATMENTS),
        ("ctc_treatment", CTC_TREATMENTS),
    ):
        if hparams[key] not in allowed:
            raise ValueError(f"{key}: {hparams[key]!r} must be one of {allowed}")
    if (
        not hparams["train_llm_lora"]
        and hparams["connector_treatment"] == "freeze"
        and hparams["freeze_encoder"]
    ):
        raise ValueError(
            "train_llm_lora: False, connector_treatment: freeze and freeze_encoder: True leave "
            "nothing to train"
        )
    if not isinstance(hparams["shipped_seed"], bool):
        raise ValueError(f"shipped_seed: {hparams['shipped_seed']!r} must be True or False")
    if hparams["group_by"] not in GROUPINGS:
        raise ValueError(f"group_by: {hparams['group_by']!r} must be one of {sorted(GROUPINGS)}")
    if hparams["scenario"] not in ("federated", "centralized"):
        raise ValueError(f"scenario: {hparams['scenario']!r} must be federated or centralized")
    steps = hparams["central_steps"]
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"central_steps: {steps!r} must be a positive integer or null")
    cache_mb = hparams["feature_cache_mb"]
    if isinstance(cache_mb, bool) or not isinstance(cache_mb, int) or cache_mb < 0:
        raise ValueError(f"feature_cache_mb: {cache_mb!r} must be an integer >= 0 (MB; 0 = off)")
    workers = hparams.get("corpus_workers")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(f"corpus_workers: {workers!r} must be a positive integer or null")
    kappa = hparams["alpha_kappa"]
    if isinstance(kappa, bool) or not isinstance(kappa, int | float) or not 0 < kappa < math.inf:
        raise ValueError(f"alpha_kappa: {kappa!r} must be a positive number")
    if hparams["alpha"] == "auto" and hparams["profile_rounds"] < 1:
        raise ValueError("alpha: auto needs profile_rounds >= 1 to measure the norms")
    # method, clip, noise and alpha: the engine config's own checks (alpha: auto is resolved
    # by the profiling, so any valid alpha stands in for it here)
    if hparams["alpha"] == "auto":
        hparams = {**hparams, "alpha": 0.5, "method": with_settings(hparams["method"], alpha=0.5)}
    FLConfig.from_hparams(engine_hparams(hparams))

"""Speech-LLM presets (the alpha-split paper's models) and ``build_speech_llm``.

Presets (real Hugging Face IDs; the real ones are meant for ``--device=cuda --precision=bf16``):

============================  =================================================================
``whisper_tinyllama``         openai/whisper-large-v3-turbo encoder + linear connector (k=4) +
                              TinyLlama/TinyLlama-1.1B-Chat-v1.0 (paper Sec. II-A, Table I)
``whisper_eurollm``           same encoder and connector + utter-project/EuroLLM-1.7B-Instruct
``voxtral``                   mistralai/Voxtral-Mini-3B-2507 (one ``VoxtralForConditionalGeneration``
                              split into ``audio_tower`` -> encoder, ``multi_modal_projector`` ->
                              connector (k=4 stacking + 2-layer MLP, pretrained, not from scratch),
                              ``language_model`` + ``lm_head`` -> llm)
``tiny``                      random tiny Whisper encoder + Llama built by
                              :mod:`speechbrain_fl.models.tiny` into ``cache_dir`` (CPU, tests)
============================  =================================================================

A preset may also be a folder holding ``speech_llm.json`` (what ``SpeechLLM.save_pretrained`` and
``create_tiny_checkpoint`` write, e.g. the pretrained tiny seed), or a dict ``{"preset": name,
<overrides>}`` / a full spec dict with ``kind``. Every path loads through transformers'
``from_pretrained``; offline (``HF_HUB_OFFLINE=1``) only local folders work.

Trainable counts for ``whisper_tinyllama`` (r=8) against the paper's Table I (checked on meta
devices in ``tests/unit/test_speech_llm.py``): encoder 32 layers x {q,k,v} x {A,B} tensors of
r*1280 = 10,240 -> 1,966,080 (Table I total; its "64 matrices" is not 192 tensors, so its
matrix column counts differently from its total). LLM: 22 layers x {q,v} = 44 modules and
r*2048 = 16,384 per A matrix; Table I's 720,896 equals the lora_A tensors alone, while A+B with
grouped-query attention (v_proj out 256) is 1,126,400. Connector: a linear k*1280 -> 2048 projection
has 4*1280*2048 + 2048 parameters, not Table I's 2 x 2,048 (that is one weight+bias pair of size
2048), which this code cannot reproduce with a linear connector.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from speechbrain_fl.models.connector import FrameStackConnector
from speechbrain_fl.models.speech_llm import (
    ENCODER_LORA_TARGETS,
    LLM_LORA_TARGETS,
    SpeechLLM,
    add_lora,
)
from speechbrain_fl.models.tiny import create_tiny_checkpoint, tiny_config_tag

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "Transcribe the audio:"
PRESETS: dict[str, dict] = {
    "whisper_tinyllama": {
        "kind": "whisper_llm",
        "encoder": "openai/whisper-large-v3-turbo",
        "llm": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        "connector": "linear",
        "downsample_k": 4,
        "prompt": DEFAULT_PROMPT,
        "max_new_tokens": 256,
    },
    "whisper_eurollm": {
        "kind": "whisper_llm",
        "encoder": "openai/whisper-large-v3-turbo",
        "llm": "utter-project/EuroLLM-1.7B-Instruct",
        "connector": "linear",
        "downsample_k": 4,
        "prompt": DEFAULT_PROMPT,
        "max_new_tokens": 256,
    },
    "voxtral": {
        "kind": "voxtral",
        "model": "mistralai/Voxtral-Mini-3B-2507",
        # Keep Voxtral's pretrained projector (stacking k=4 + 2-layer MLP): without these keys
        # build_speech_llm would replace it by a fresh linear connector unless the caller
        # passed connector="mlp" (checked by speechbrain_fl.models.configs.check_preset).
        "connector": "mlp",
        "downsample_k": 4,
        "prompt": DEFAULT_PROMPT,
        "max_new_tokens": 256,
    },
    "tiny": {"kind": "tiny"},
}
SPEC_KEYS = {
    "kind",
    "encoder",
    "llm",
    "model",
    "connector",
    "downsample_k",
    "prompt",
    "max_new_tokens",
    "root",
}
TINY_FOLDER = "speech_llm_tiny"
CONNECTOR_TREATMENTS = ("train", "freeze")
CTC_TREATMENTS = ("train", "freeze", "off")


def connector_budget_share(layout) -> float | None:
    """The connector's share of the LLM + connector pool budget under size-proportional budgets.

    With PFL-Dim or alpha-split budgets C_l proportional to sqrt(p_l) inside a pool (Eq. 9,
    Eq. 13), the connector's groups together get sqrt(p_connector / (p_connector + p_llm)) of the
    pool's budget and the LLM's adapters sqrt(p_llm / (p_connector + p_llm)). ``layout`` is any
    iterable of groups with ``component`` and ``numel``. None when the connector does not train.

    Example
    -------
    >>> from types import SimpleNamespace as G
    >>> lay = [G(component="connector", numel=10_487_808), G(component="llm", numel=1_126_400)]
    >>> round(connector_budget_share(lay), 3)
    0.95
    """
    sizes = {"connector": 0, "llm": 0}
    for group in layout:
        if group.component in sizes:
            sizes[group.component] += int(group.numel)
    if not sizes["connector"]:
        return None
    return (sizes["connector"] / (sizes["connector"] + sizes["llm"])) ** 0.5


def resolve_preset(preset: str | dict, *, cache_dir: str | Path | None = None) -> dict:
    """Turn a preset name, checkpoint folder or dict into a validated spec (nothing loaded).

    Raises
    ------
    ValueError
        Unknown preset name (listing the known ones) or an unknown spec key.

    Example
    -------
    >>> resolve_preset("whisper_eurollm")["llm"]
    'utter-project/EuroLLM-1.7B-Instruct'
    """
    if isinstance(preset, dict):
        spec = dict(preset)
        name = spec.pop("preset", None)
        if name is not None:
            spec = {**resolve_preset(name, cache_dir=cache_dir), **spec}
    elif isinstance(preset, str | Path) and str(preset) in PRESETS:
        spec = dict(PRESETS[str(preset)])
    elif isinstance(preset, str | Path) and (Path(preset) / "speech_llm.json").is_file():
        folder = Path(preset)
        spec = json.loads((folder / "speech_llm.json").read_text())
        spec["root"] = str(folder)
    else:
        raise ValueError(
            f"unknown speech-LLM preset {preset!r}: use one of {sorted(PRESETS)} or a folder "
            "holding speech_llm.json (written by SpeechLLM.save_pretrained)"
        )
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ValueError(
            f"unknown speech-LLM spec key(s) {sorted(unknown)}; known: {sorted(SPEC_KEYS)}"
        )
    if spec.get("kind") == "tiny":
        root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "speechbrain_fl"
        spec["tiny_folder"] = str(root / f"{TINY_FOLDER}_{tiny_config_tag()}")
        return spec
    if spec.get("kind") not in ("whisper_llm", "voxtral"):
        raise ValueError(
            f"speech-LLM spec kind {spec.get('kind')!r} is not whisper_llm|voxtral|tiny"
        )
    return spec


def _path(spec: dict, key: str) -> str:
    """A component's location: relative to the checkpoint folder when there is one."""
    value = spec[key]
    if "root" in spec and not Path(value).is_absolute():
        return str(Path(spec["root"]) / value)
    return value


def _load_whisper_llm(spec: dict, *, cache_dir, dtype):
    from transformers import (
        AutoFeatureExtractor,
        AutoModelForCausalLM,
        AutoTokenizer,
        WhisperModel,
    )

    hub = {"cache_dir": str(cache_dir)} if cache_dir and "root" not in spec else {}
    encoder_path, llm_path = _path(spec, "encoder"), _path(spec, "llm")
    encoder = WhisperModel.from_pretrained(encoder_path, dtype=dtype, **hub).encoder
    features = AutoFeatureExtractor.from_pretrained(encoder_path, **hub)
    llm = AutoModelForCausalLM.from_pretrained(llm_path, dtype=dtype, **hub)
    tokenizer = AutoTokenizer.from_pretrained(llm_path, **hub)
    return encoder, llm, tokenizer, features, None


def split_voxtral(vox) -> tuple:
    """Split a ``VoxtralForConditionalGeneration`` into (encoder, connector, llm).

    encoder = ``model.audio_tower``; connector = :class:`FrameStackConnector` (``mlp``, no bias,
    k = audio ``intermediate_size / d_model`` = 4) loaded from ``model.multi_modal_projector``;
    llm = a ``LlamaForCausalLM`` shell (built on the meta device) whose ``model`` and ``lm_head``
    are Voxtral's ``language_model`` and ``lm_head`` (no weight is copied).
    """
    from transformers import AutoModelForCausalLM

    config = vox.config
    audio = config.audio_config
    connector = FrameStackConnector(
        input_size=audio.d_model,
        output_size=config.text_config.hidden_size,
        downsample_k=audio.intermediate_size // audio.d_model,
        kind="mlp",
        bias=False,
        activation=config.projector_hidden_act,
    )
    projector = vox.model.multi_modal_projector
    connector.to(projector.linear_1.weight.device)
    connector.load_state_dict(projector.state_dict(), assign=True)
    with torch.device("meta"):
        llm = AutoModelForCausalLM.from_config(config.text_config)
    llm.model = vox.model.language_model
    llm.lm_head = vox.lm_head
    return vox.model.audio_tower, connector, llm


def _load_voxtral(spec: dict, *, cache_dir, dtype):
    from transformers import AutoFeatureExtractor, AutoTokenizer, VoxtralForConditionalGeneration

    hub = {"cache_dir": str(cache_dir)} if cache_dir and "root" not in spec else {}
    path = _path(spec, "model")
    vox = VoxtralForConditionalGeneration.from_pretrained(path, dtype=dtype, **hub)
    encoder, connector, llm = split_voxtral(vox)
    features = AutoFeatureExtractor.from_pretrained(path, **hub)
    tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    return encoder, llm, tokenizer, features, connector


def build_speech_llm(
    preset: str | dict,
    *,
    cache_dir: str | Path | None = None,
    freeze_encoder: bool = True,
    lora_r: int = 8,
    lora_alpha: int = 16,
    connector: str | None = None,
    downsample_k: int | None = None,
    ctc_weight: float = 0.0,
    prompt: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    gradient_checkpointing: bool = False,
    seed: int | None = None,
    train_llm_lora: bool = True,
    connector_treatment: str = "train",
    ctc_treatment: str = "train",
    feature_cache_mb: int = 0,
) -> SpeechLLM:
    """Load a preset, add LoRA and mark trainable parameters (paper Sec. II-A and II-D).

    Arguments
    ---------
    preset : str or dict
        A name in :data:`PRESETS`, a checkpoint folder, or a spec dict (see :func:`resolve_preset`).
    cache_dir : str or Path, optional
        Hugging Face cache for hub models; root folder of the ``tiny`` checkpoint.
    freeze_encoder : bool
        True: no encoder LoRA (paper's frozen variants); False: LoRA on encoder q/k/v (``-e``).
    lora_r, lora_alpha : int
        LoRA rank and scaling numerator (paper: r=8, alpha=16, dropout 0). ``lora_r=0`` adds no
        adapters (base model with a trainable connector, used for seed pretraining).
    connector, downsample_k : optional
        Override the preset's connector kind (``linear``/``mlp``) and stacking factor.
    ctc_weight : float
        Weight of the CTC auxiliary loss on the encoder; ignored (with a log line) when the
        encoder is frozen, since the head could not influence the transcript loss.
    prompt : str, optional
        Override the task prompt.
    device, dtype :
        Where and in which dtype the frozen base weights live; trainable tensors stay float32
        (run under autocast, e.g. SpeechBrain ``--precision=bf16``).
    gradient_checkpointing : bool
        Enable non-reentrant gradient checkpointing in encoder and LLM.
    seed : int, optional
        Seed for the connector / LoRA / CTC-head initialisation.
    train_llm_lora : bool
        Train the LLM's LoRA adapters (the paper's setting). False keeps them frozen: the
        federated update is then the encoder adapters (unless frozen), CTC head and connector.
        Ours, for the tiny model: its LLM adapters, trained on client transcripts, learn to
        continue the text and stop reading the audio (``recipes/MLS/README.md``).
    feature_cache_mb : int
        Keep up to this many MB of per-utterance log-mel features and reuse them for the same
        waveform (:meth:`SpeechLLM.use_feature_cache`: exact); 0 (default) computes them every
        time.

    Returns
    -------
    SpeechLLM
        With ``.tokenizer`` and ``.feature_extractor`` attached.

    Example
    -------
    >>> import tempfile
    >>> model = build_speech_llm("tiny", cache_dir=tempfile.mkdtemp(), seed=0)
    >>> sorted(model.component_patterns())
    ['connector', 'encoder', 'llm']
    """
    if (
        isinstance(feature_cache_mb, bool)
        or not isinstance(feature_cache_mb, int)
        or feature_cache_mb < 0
    ):
        raise ValueError(f"feature_cache_mb: {feature_cache_mb!r} must be an integer >= 0 (MB)")
    spec = _resolved_spec(preset, cache_dir=cache_dir)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    loader = _load_voxtral if spec["kind"] == "voxtral" else _load_whisper_llm
    parts = loader(spec, cache_dir=cache_dir, dtype=dtype)
    if freeze_encoder and ctc_weight > 0:
        logger.info("ctc_weight=%s ignored: the encoder is frozen", ctc_weight)
        ctc_weight = 0.0
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = _assemble(
            spec,
            parts,
            connector=connector,
            downsample_k=downsample_k,
            prompt=prompt,
            ctc_weight=ctc_weight,
            lora_r=lora_r,
            lora_alpha=lora_alpha,
            encoder_lora=not freeze_encoder,
        )
    _mark_trainable(
        model,
        train_encoder_lora=not freeze_encoder,
        train_llm_lora=train_llm_lora,
        connector_treatment=connector_treatment,
        ctc_treatment=ctc_treatment,
    )
    if gradient_checkpointing:
        for part in (model.encoder, model.llm):
            part.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    model.use_feature_cache(feature_cache_mb << 20)
    return model.to(device)


def _resolved_spec(preset: str | dict, *, cache_dir: str | Path | None) -> dict:
    """:func:`resolve_preset`'s spec; for ``tiny``, the spec of its checkpoint folder (created
    on first use) with the preset's own keys on top."""
    spec = resolve_preset(preset, cache_dir=cache_dir)
    if spec.get("kind") == "tiny":
        folder = create_tiny_checkpoint(spec.pop("tiny_folder"))
        spec = {**resolve_preset(str(folder)), **{k: v for k, v in spec.items() if k != "kind"}}
    return spec


def _assemble(
    spec: dict,
    parts: tuple,
    *,
    connector: str | None,
    downsample_k: int | None,
    prompt: str | None,
    ctc_weight: float,
    lora_r: int,
    lora_alpha: int,
    encoder_lora: bool,
) -> SpeechLLM:
    """The :class:`SpeechLLM` of a loader's ``(encoder, llm, tokenizer, features, connector)``.

    The connector is the checkpoint's or a new one (:func:`_connector`), the checkpoint's
    ``extra.safetensors`` is loaded (:func:`_load_extra`), then LoRA adapters of rank
    ``lora_r`` (none at 0) go on the LLM and, with ``encoder_lora``, on the encoder. New
    weights draw from the current torch seed. Arguments left ``None`` take the spec's value.
    """
    encoder, llm, tokenizer, features, pretrained_connector = parts
    conn = _connector(
        pretrained_connector,
        input_size=encoder.config.d_model,
        output_size=llm.config.hidden_size,
        kind=connector or spec.get("connector", "linear"),
        downsample_k=downsample_k or spec.get("downsample_k", 4),
    )
    model = SpeechLLM(
        encoder=encoder,
        connector=conn,
        llm=llm,
        tokenizer=tokenizer,
        feature_extractor=features,
        prompt=prompt or spec.get("prompt", DEFAULT_PROMPT),
        ctc_weight=ctc_weight,
        max_new_tokens=spec.get("max_new_tokens", 256),
    )
    _load_extra(model, spec)
    if lora_r > 0:
        add_lora(model.llm, targets=LLM_LORA_TARGETS, r=lora_r, alpha=lora_alpha)
        if encoder_lora:
            add_lora(model.encoder, targets=ENCODER_LORA_TARGETS, r=lora_r, alpha=lora_alpha)
    return model


def _connector(
    pretrained: FrameStackConnector | None,
    *,
    input_size: int,
    output_size: int,
    kind: str,
    downsample_k: int,
) -> FrameStackConnector:
    """The checkpoint's connector when it is of the requested ``kind`` and ``downsample_k``,
    else a freshly initialised one (from the current torch seed)."""
    if pretrained is not None and (kind, downsample_k) == (
        pretrained.kind,
        pretrained.downsample_k,
    ):
        return pretrained
    return FrameStackConnector(
        input_size=input_size, output_size=output_size, downsample_k=downsample_k, kind=kind
    )


def _mark_trainable(
    model: SpeechLLM,
    *,
    train_encoder_lora: bool,
    train_llm_lora: bool,
    connector_treatment: str,
    ctc_treatment: str,
) -> None:
    """Mark the federated update's parameters trainable and keep them in float32.

    ``ValueError`` for a connector or CTC treatment outside :data:`CONNECTOR_TREATMENTS` /
    :data:`CTC_TREATMENTS`; ``ctc_treatment="off"`` also drops the CTC loss (weight 0).
    """
    if connector_treatment not in CONNECTOR_TREATMENTS:
        raise ValueError(
            f"connector_treatment: {connector_treatment!r} must be one of {CONNECTOR_TREATMENTS}"
        )
    if ctc_treatment not in CTC_TREATMENTS:
        raise ValueError(f"ctc_treatment: {ctc_treatment!r} must be one of {CTC_TREATMENTS}")
    if ctc_treatment == "off":
        model.ctc_weight = 0.0
    model.set_trainable(
        train_encoder_lora=train_encoder_lora,
        train_llm_lora=train_llm_lora,
        train_connector=connector_treatment == "train",
        train_ctc_head=ctc_treatment == "train",
    )
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()


def _load_extra(model: SpeechLLM, spec: dict) -> None:
    """Load ``extra.safetensors`` (connector, CTC head) of a checkpoint folder when present."""
    if "root" not in spec or not (Path(spec["root"]) / "extra.safetensors").is_file():
        return
    path = Path(spec["root"]) / "extra.safetensors"
    state = load_file(str(path))
    for prefix, module in (("connector.", model.connector), ("ctc_head.", model.ctc_head)):
        part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if module is None or not part:
            continue
        try:
            module.load_state_dict(part)
        except RuntimeError as err:
            raise ValueError(
                f"{path}: saved {prefix.rstrip('.')} weights do not fit the requested "
                f"connector/downsample_k: {err}"
            ) from err

"""Architecture configs of the real speech-LLM presets, so they can be built offline.

The configs are data in ``speechbrain_fl/models/configs/`` (package data); this module reads,
checks and writes them. One folder per Hugging Face model used by :data:`speechbrain_fl.models.presets.PRESETS`, named
like the hub cache (``owner--name``), holding what is needed to build the exact architecture
with random weights:

- ``config.json``: the model config as published on the hub;
- ``preprocessor_config.json``: the ``WhisperFeatureExtractor`` (encoders only);
- ``tokenizer_settings.json`` (LLMs only): vocabulary size, special tokens and their ids, chat
  template. The real tokenizers cannot be downloaded here, so :func:`standin_tokenizer` builds a
  **stand-in** of the real vocabulary size with the real special-token ids (one token per
  character of the MLS alphabets, the other ids placeholders); each file says so;
- ``source.json``: model ID, revision, published parameter count and notes.

:func:`write_checkpoint` writes a folder laid out like the hub's (``save_pretrained`` of the
hub's architecture class, feature extractor, tokenizer) and :func:`offline_preset` returns a
preset spec whose hub IDs are replaced by such folders, so ``build_speech_llm`` loads it through
the very ``from_pretrained`` calls it uses for the hub. :func:`check_preset` compares the configs
with what the code expects (:data:`EXPECTED` dimensions documented by the presets and the
paper's Table I, feature-extractor window and mel bins, module names LoRA targets, tokenizer
size) on meta-device builds, and counts parameters per component without allocating weights.

``num_layers`` (every builder takes it) is an explicit, documented reduction for cheap tests: it
caps each transformer stack (encoder layers, LLM layers; Whisper's unused decoder too) at that
many layers and changes nothing else (widths, heads, vocabulary, mel bins, 30 s window).

Example
-------
>>> hub_ids("whisper_tinyllama")
{'encoder': 'openai/whisper-large-v3-turbo', 'llm': 'TinyLlama/TinyLlama-1.1B-Chat-v1.0'}
>>> model_config("TinyLlama/TinyLlama-1.1B-Chat-v1.0").hidden_size
2048
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CONFIG_ROOT = Path(__file__).resolve().parent / "configs"  # the JSON files, one folder per model
HUB_KEYS = ("encoder", "llm", "model")

# Dimensions the code and its documentation rely on (presets.py docstring, the alpha-split
# paper's Table I: encoder LoRA matrices r*1280 over 32 layers, LLM r*2048 over 22 layers,
# 128 mel bins, k=4 stacking for Voxtral's projector). ``layers`` keys are skipped when a
# ``num_layers`` reduction is asked for.
EXPECTED: dict[str, dict[str, int]] = {
    "openai/whisper-large-v3-turbo": {
        "d_model": 1280,
        "encoder_layers": 32,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    },
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "vocab_size": 32000,
    },
    "utter-project/EuroLLM-1.7B-Instruct": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "vocab_size": 128000,
    },
    "mistralai/Voxtral-Mini-3B-2507": {
        "audio_config.hidden_size": 1280,
        "audio_config.num_hidden_layers": 32,
        "audio_config.num_mel_bins": 128,
        "audio_config.intermediate_size": 5120,
        "text_config.hidden_size": 3072,
        "text_config.num_hidden_layers": 30,
        "text_config.vocab_size": 131072,
    },
}
LAYER_KEYS = ("encoder_layers", "decoder_layers", "num_hidden_layers")


class PresetConfigError(ValueError):
    """A preset's config disagrees with the code; the message names the file and key."""


def config_folder(model_id: str, *, root: str | Path | None = None) -> Path:
    """The folder of ``model_id``'s configs (``owner--name`` under ``root``).

    Raises
    ------
    FileNotFoundError
        Naming the folder and the models that have configs.
    """
    root = Path(root) if root is not None else CONFIG_ROOT
    folder = root / model_id.replace("/", "--")
    if not (folder / "config.json").is_file():
        known = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
        raise FileNotFoundError(f"no config.json for {model_id!r} in {folder}; have {known}")
    return folder


def load_json(model_id: str, name: str, *, root: str | Path | None = None) -> dict | None:
    """One JSON file of ``model_id``'s configs, or None when the model has no such file."""
    path = config_folder(model_id, root=root) / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PresetConfigError(f"{path} is not valid JSON: {err}") from None


def _reduce_layers(values: dict, num_layers: int) -> dict:
    """Cap every layer count of a config dict (and its sub-configs) at ``num_layers``."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            value = _reduce_layers(value, num_layers)
        elif key in LAYER_KEYS and isinstance(value, int):
            value = min(value, num_layers)
        out[key] = value
    return out


def model_config(model_id: str, *, num_layers: int | None = None, root: str | Path | None = None):
    """The transformers config built from ``config.json`` (``AutoConfig.for_model``).

    Arguments
    ---------
    model_id : str
        Hugging Face ID, e.g. ``"openai/whisper-large-v3-turbo"``.
    num_layers : int, optional
        Cap every layer count at this value (cheap tests only; see the module docstring).
    root : str or Path, optional
        Folder holding the ``owner--name`` config folders (default: this package).
    """
    from transformers import AutoConfig

    values = load_json(model_id, "config.json", root=root)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        values = _reduce_layers(values, num_layers)
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        path = config_folder(model_id, root=root) / "config.json"
        raise PresetConfigError(f"{path}: no model_type key")
    return AutoConfig.for_model(model_type, **values)


def feature_extractor(model_id: str, *, root: str | Path | None = None):
    """The ``WhisperFeatureExtractor`` of ``preprocessor_config.json`` (None when absent)."""
    from transformers import WhisperFeatureExtractor

    values = load_json(model_id, "preprocessor_config.json", root=root)
    if values is None:
        return None
    values = {k: v for k, v in values.items() if k not in ("feature_extractor_type",)}
    return WhisperFeatureExtractor(**values)


def standin_tokenizer(model_id: str, *, root: str | Path | None = None):
    """A stand-in tokenizer of the real vocabulary size and special-token ids (None if none).

    The real tokenizers (SentencePiece, Tekken) cannot be downloaded here. The stand-in is a
    ``PreTrainedTokenizerFast`` (word-level over single characters, NFC + lowercase): the special
    tokens sit at the ids of ``tokenizer_settings.json``, then one id per character of the MLS
    alphabets (:data:`speechbrain_fl.models.tiny.MLS_ALPHABET`), then ``<standin_N>`` placeholders
    up to ``vocab_size``, so ``len(tokenizer)`` equals the model's vocabulary.

    Example
    -------
    >>> tok = standin_tokenizer("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    >>> len(tok), tok.bos_token_id, tok.eos_token_id, tok.decode(tok("Ça va").input_ids[1:])
    (32000, 1, 2, 'ça va')
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from speechbrain_fl.models.tiny import MLS_ALPHABET

    settings = load_json(model_id, "tokenizer_settings.json", root=root)
    if settings is None:
        return None
    path = config_folder(model_id, root=root) / "tokenizer_settings.json"
    size = int(settings["vocab_size"])
    special = {str(tok): int(i) for tok, i in settings["special_tokens"].items()}
    bad = {t: i for t, i in special.items() if not 0 <= i < size}
    if bad or len(set(special.values())) != len(special):
        raise PresetConfigError(f"{path}: special_tokens {special} must be distinct ids < {size}")
    vocab: dict[str, int] = dict(special)
    free = (i for i in range(size) if i not in set(special.values()))
    for char in dict.fromkeys(MLS_ALPHABET):
        vocab[char] = next(free)
    for i in free:
        vocab[f"<standin_{i}>"] = i
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=settings["unk_token"]))
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    # Only the BOS token is added by ``add_special_tokens`` (as the real Llama tokenizers do).
    bos = settings.get("bos_token")
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, special[bos])]
        )
    named = {
        key: settings[key]
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if settings.get(key) is not None
    }
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=settings.get("model_max_length"),
        additional_special_tokens=[t for t in special if t not in named.values()],
        **named,
    )
    if settings.get("chat_template"):
        tokenizer.chat_template = settings["chat_template"]
    if len(tokenizer) != size:
        raise PresetConfigError(f"{path}: stand-in has {len(tokenizer)} tokens, not {size}")
    return tokenizer


def hub_ids(preset: str) -> dict[str, str]:
    """The hub IDs of a real preset, keyed by its spec key (``encoder``/``llm`` or ``model``)."""
    from speechbrain_fl.models.presets import PRESETS

    spec = PRESETS.get(preset)
    if spec is None or spec.get("kind") not in ("whisper_llm", "voxtral"):
        real = sorted(k for k, v in PRESETS.items() if v.get("kind") != "tiny")
        raise ValueError(f"{preset!r} is not a real (hub) preset; use one of {real}")
    return {key: spec[key] for key in HUB_KEYS if key in spec}


# ------------------------------------------------------------------------------------ checks
def _get(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _check_expected(model_id: str, config, *, reduced: bool, root) -> None:
    path = config_folder(model_id, root=root) / "config.json"
    for key, want in EXPECTED.get(model_id, {}).items():
        if reduced and key.split(".")[-1] in LAYER_KEYS:
            continue
        have = _get(config, key)
        if have != want:
            raise PresetConfigError(
                f"{path}: {key} = {have}, but the code expects {want} for {model_id} "
                "(presets.py and the paper's Table I)"
            )


def _check_lora_targets(module: torch.nn.Module, targets, *, what: str, path: Path) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in module.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise PresetConfigError(
            f"{path}: the {what} built from it ({type(module).__name__}) has no module named "
            f"{missing} that LoRA targets (speech_llm.py: {what.upper()}_LORA_TARGETS = "
            f"{tuple(targets)})"
        )


def _check_features(model_id: str, features, enc_config, *, root) -> None:
    path = config_folder(model_id, root=root)
    if features is None:
        raise PresetConfigError(f"{path}: no preprocessor_config.json (the encoder's front end)")
    if features.feature_size != enc_config.num_mel_bins:
        raise PresetConfigError(
            f"{path / 'preprocessor_config.json'}: feature_size = {features.feature_size} mel "
            f"bins, but config.json num_mel_bins = {enc_config.num_mel_bins}"
        )
    if features.nb_max_frames != 2 * enc_config.max_source_positions:
        raise PresetConfigError(
            f"{path / 'preprocessor_config.json'}: pads to {features.nb_max_frames} frames, but "
            f"config.json max_source_positions = {enc_config.max_source_positions} needs "
            f"{2 * enc_config.max_source_positions} (SpeechLLM's encoder window)"
        )


def _check_tokenizer(model_id: str, tokenizer, vocab_size: int, *, root) -> None:
    path = config_folder(model_id, root=root) / "tokenizer_settings.json"
    if tokenizer is None:
        raise PresetConfigError(f"{path} is missing: the LLM needs its tokenizer settings")
    if len(tokenizer) != vocab_size:
        raise PresetConfigError(
            f"{path}: vocab_size = {len(tokenizer)}, but config.json vocab_size = {vocab_size}"
        )
    if tokenizer.eos_token_id is None:
        raise PresetConfigError(f"{path}: no eos_token (transcripts end with EOS)")


def _count(model) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for name, param in model.named_parameters():
        row = counts.setdefault(
            model.component_of(name), {"total": 0, "trainable": 0, "trainable_lora_groups": 0}
        )
        row["total"] += param.numel()
        row["trainable"] += param.numel() if param.requires_grad else 0
        row["trainable_lora_groups"] += int(param.requires_grad and "lora_" in name)
    return counts


def check_preset(
    preset: str,
    *,
    num_layers: int | None = None,
    root: str | Path | None = None,
    lora_r: int = 8,
    lora_alpha: int = 16,
    connector: str | None = None,
    downsample_k: int | None = None,
    train_llm_lora: bool = True,
    connector_treatment: str = "train",
    return_models: bool = False,
) -> dict[str, dict]:
    """Check a real preset's configs against the code on meta-device builds (no weights).

    Checks, each failing with a :class:`PresetConfigError` naming the file and key: the
    :data:`EXPECTED` dimensions; mel bins and window of the feature extractor against the
    encoder config; the tokenizer's size and EOS against the LLM config; that the module names
    LoRA targets (``ENCODER_LORA_TARGETS``, ``LLM_LORA_TARGETS`` of ``speech_llm.py``) exist in
    the built encoder and LLM. Then builds the :class:`SpeechLLM` on the meta device for both
    ``freeze_encoder`` settings (LoRA and trainable flags as ``build_speech_llm`` sets them,
    from ``train_llm_lora`` and ``connector_treatment``, e.g. a recipe's model options).

    Returns
    -------
    dict
        ``{"frozen": counts, "unfrozen": counts}`` with ``counts = {component: {"total",
        "trainable", "trainable_lora_groups"}}`` (parameter numbers; trainable LoRA tensors);
        with ``return_models``, ``{"frozen": model, "unfrozen": model}``: the checked
        :class:`SpeechLLM` builds themselves, on the meta device (shapes, no values).

    Example
    -------
    >>> counts = check_preset("whisper_tinyllama", num_layers=1)
    >>> counts["unfrozen"]["encoder"]["trainable"]  # 1 layer x {q,k,v} x (A + B) of r*1280
    61440
    """
    from transformers import AutoModelForCausalLM, WhisperModel

    from speechbrain_fl.models.connector import FrameStackConnector
    from speechbrain_fl.models.presets import resolve_preset, split_voxtral
    from speechbrain_fl.models.speech_llm import (
        ENCODER_LORA_TARGETS,
        LLM_LORA_TARGETS,
        SpeechLLM,
        add_lora,
    )

    ids = hub_ids(preset)
    spec = resolve_preset(preset)
    reduced = num_layers is not None
    configs = {key: model_config(mid, num_layers=num_layers, root=root) for key, mid in ids.items()}
    for key, mid in ids.items():
        _check_expected(mid, configs[key], reduced=reduced, root=root)
    enc_id = ids.get("encoder", ids.get("model"))
    llm_id = ids.get("llm", ids.get("model"))
    features = feature_extractor(enc_id, root=root)
    tokenizer = standin_tokenizer(llm_id, root=root)
    if spec["kind"] == "voxtral":
        audio, text = configs["model"].audio_config, configs["model"].text_config
        enc_cfg, vocab = audio, text.vocab_size
    else:
        enc_cfg, vocab = configs["encoder"], configs["llm"].vocab_size
    _check_features(enc_id, features, enc_cfg, root=root)
    _check_tokenizer(llm_id, tokenizer, vocab, root=root)

    def build(freeze_encoder: bool):
        with torch.device("meta"):
            if spec["kind"] == "voxtral":
                from transformers import VoxtralForConditionalGeneration

                vox = VoxtralForConditionalGeneration(configs["model"])
        if spec["kind"] == "voxtral":
            encoder, pretrained, llm = split_voxtral(vox)
        else:
            with torch.device("meta"):
                encoder = WhisperModel(configs["encoder"]).encoder
                llm = AutoModelForCausalLM.from_config(configs["llm"])
            pretrained = None
        kind = connector or spec.get("connector", "linear")
        k = downsample_k or spec.get("downsample_k", 4)
        conn = pretrained
        if conn is None or (kind, k) != (conn.kind, conn.downsample_k):
            with torch.device("meta"):
                conn = FrameStackConnector(
                    input_size=encoder.config.d_model,
                    output_size=llm.config.hidden_size,
                    downsample_k=k,
                    kind=kind,
                )
        enc_path = config_folder(enc_id, root=root) / "config.json"
        llm_path = config_folder(llm_id, root=root) / "config.json"
        _check_lora_targets(encoder, ENCODER_LORA_TARGETS, what="encoder", path=enc_path)
        _check_lora_targets(llm, LLM_LORA_TARGETS, what="llm", path=llm_path)
        model = SpeechLLM(
            encoder=encoder,
            connector=conn,
            llm=llm,
            tokenizer=tokenizer,
            feature_extractor=features,
            prompt=spec.get("prompt", "Transcribe the audio:"),
        )
        if lora_r > 0:
            add_lora(model.llm, targets=LLM_LORA_TARGETS, r=lora_r, alpha=lora_alpha)
            if not freeze_encoder:
                add_lora(model.encoder, targets=ENCODER_LORA_TARGETS, r=lora_r, alpha=lora_alpha)
        model.set_trainable(
            train_encoder_lora=not freeze_encoder,
            train_llm_lora=train_llm_lora,
            train_connector=connector_treatment == "train",
        )
        return model

    if return_models:
        return {"frozen": build(True), "unfrozen": build(False)}
    return {
        "frozen": _count(build(True)),
        "unfrozen": _count(build(False)),
    }


# ------------------------------------------------------------------------------ checkpoints
def write_checkpoint(
    model_id: str,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int | None = None,
    seed: int = 0,
    root: str | Path | None = None,
) -> Path:
    """Write ``model_id`` with random weights to ``folder``, laid out like its hub repository.

    Builds the config's ``architectures[0]`` class (e.g. ``WhisperForConditionalGeneration``)
    with transformers' own random initialisation in ``dtype``, then ``save_pretrained`` of the
    model, the feature extractor and the stand-in tokenizer when the model has them, and an
    ``offline_source.json`` saying where it came from. Written through
    :func:`speechbrain_fl.utils.atomic.atomic_folder` (complete or absent).

    Returns
    -------
    Path
        ``folder``.
    """
    import transformers

    from speechbrain_fl.utils.atomic import atomic_folder

    config = model_config(model_id, num_layers=num_layers, root=root)
    cls = getattr(transformers, config.architectures[0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, dtype=dtype)
    features = feature_extractor(model_id, root=root)
    tokenizer = standin_tokenizer(model_id, root=root)
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp)
        del model
        if features is not None:
            features.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        source = load_json(model_id, "source.json", root=root) or {}
        note = {
            "model_id": model_id,
            "revision": source.get("revision"),
            "weights": f"random (seed {seed}), {str(dtype).removeprefix('torch.')}",
            "num_layers": num_layers,
            "tokenizer": "stand-in (speechbrain_fl.models.configs.standin_tokenizer)"
            if tokenizer is not None
            else None,
        }
        (tmp / "offline_source.json").write_text(json.dumps(note, indent=2) + "\n")
    return folder


def offline_preset(
    preset: str,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int | None = None,
    seed: int = 0,
    root: str | Path | None = None,
) -> dict:
    """Write a real preset's models (random weights) under ``folder``; return its spec dict.

    The returned ``{"preset": name, <key>: <local folder>}`` goes to ``build_speech_llm`` in
    place of the preset name: the hub IDs are replaced by local folders and everything else
    (connector, prompt, loading code) is the preset's. A model folder already holding
    ``offline_source.json`` is reused. (Exercised by ``benchmarks/real_presets.py`` and
    ``tests/integration/test_real_presets.py``; writing even a 1-layer build takes seconds.)
    """
    folder = Path(folder)
    spec: dict = {"preset": preset}
    for key, model_id in hub_ids(preset).items():
        target = folder / model_id.replace("/", "--")
        if not (target / "offline_source.json").is_file():
            logger.info("Writing %s with random weights to %s", model_id, target)
            write_checkpoint(
                model_id, target, dtype=dtype, num_layers=num_layers, seed=seed, root=root
            )
        spec[key] = str(target)
    return spec

"""The trained federated model as a loadable checkpoint folder.

A federated run changes only the trainable tensors (LoRA adapters, connector, CTC head); the
base weights are the seed model's. :func:`save_federated_model` writes::

    <folder>/
      federated_model.json     base model (preset name or folder), build options, fingerprint
      adapters/llm/            peft layout: adapter_config.json + adapter_model.safetensors
      adapters/encoder/        same, when the encoder's LoRA was trained
      extra.safetensors        connector and CTC head (the layout SpeechLLM.save_pretrained uses)
      base/                    a copy of the base folder when ``copy_base`` (small local seeds)

The adapter folders are what peft's ``save_pretrained`` writes for an adapter named
``default`` (``LoraConfig.save_pretrained`` + ``get_peft_model_state_dict``), so the LLM adapter
also loads with ``peft.PeftModel.from_pretrained(base_llm, folder / "adapters/llm")``.
:func:`load_federated_model` rebuilds the model with
:func:`~speechbrain_fl.models.presets.build_speech_llm` from the recorded base and options,
loads the adapters and the extra tensors, and checks the trainable tensors' fingerprint
(:func:`speechbrain_fl.fl.params.params_fingerprint`) against the one saved, so a load that
missed a tensor fails instead of transcribing with a half-loaded model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from speechbrain_fl.fl.params import load_trainable, params_fingerprint, trainable_state
from speechbrain_fl.utils.atomic import atomic_folder

from .presets import build_speech_llm
from .speech_llm import SpeechLLM

__all__ = ["CHECKPOINT_FILE", "load_federated_model", "save_federated_model"]

CHECKPOINT_FILE = "federated_model.json"
ADAPTER_FILE = "adapter_model.safetensors"
# Key prefix of a PeftModel's saved adapter (its wrapper's attribute path to the bare module).
PEFT_PREFIX = "base_model.model."


def save_federated_model(
    model: SpeechLLM,
    folder: str | Path,
    *,
    base: str,
    options: dict[str, Any],
    copy_base: bool = False,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write ``model``'s trainable tensors as a checkpoint folder (atomically).

    Arguments
    ---------
    model : SpeechLLM
        The model holding the final global tensors.
    folder : str or Path
        Destination (replaced).
    base : str
        Preset name or folder the model was built from.
    options : dict
        Keyword arguments of ``build_speech_llm`` that rebuild the same architecture
        (``freeze_encoder``, ``lora_r``, ``lora_alpha``, ``connector``, ...).
    copy_base : bool
        Copy a local ``base`` folder into ``<folder>/base`` (self-contained checkpoint).
    info : dict, optional
        Extra facts recorded in ``federated_model.json`` (method, rounds, epsilon).

    Returns
    -------
    Path
    """
    folder = Path(folder)
    spec: dict[str, Any] = {
        "base": str(base),
        "options": dict(options),
        "fingerprint": params_fingerprint(trainable_state(model)),
        "adapters": [],
        "info": dict(info or {}),
    }
    with atomic_folder(folder) as tmp:
        for part in ("llm", "encoder"):
            module = getattr(model, part)
            config = getattr(module, "peft_config", {}).get("default")
            state = get_peft_model_state_dict(module) if config is not None else {}
            if not state or not any(
                p.requires_grad for n, p in module.named_parameters() if "lora_" in n
            ):
                continue
            out = tmp / "adapters" / part
            out.mkdir(parents=True)
            LoraConfig.save_pretrained(config, str(out))
            save_file(
                {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()},
                out / ADAPTER_FILE,
            )
            spec["adapters"].append(part)
        extra = {f"connector.{k}": v for k, v in model.connector.state_dict().items()}
        if model.ctc_head is not None:
            extra.update({f"ctc_head.{k}": v for k, v in model.ctc_head.state_dict().items()})
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in extra.items()}, tmp / "extra.safetensors"
        )
        if copy_base and Path(base).is_dir():
            shutil.copytree(base, tmp / "base")
            spec["base"] = "base"
        (tmp / CHECKPOINT_FILE).write_text(json.dumps(spec, indent=2))
    return folder


def load_federated_model(
    folder: str | Path, *, device: str = "cpu", cache_dir: str | None = None
) -> SpeechLLM:
    """Rebuild the model a :func:`save_federated_model` folder describes.

    Raises
    ------
    OSError
        When ``folder`` has no ``federated_model.json`` or the base model is missing.
    ValueError
        When the loaded trainable tensors do not reproduce the saved fingerprint.
    """
    folder = Path(folder)
    path = folder / CHECKPOINT_FILE
    if not path.is_file():
        raise OSError(f"{folder} is not a federated model checkpoint ({CHECKPOINT_FILE} missing)")
    spec = json.loads(path.read_text())
    base = spec["base"]
    if (folder / base).is_dir():
        base = str(folder / base)
    elif Path(base).is_absolute() and not Path(base).is_dir():
        raise OSError(f"{path}: base model folder {base} is missing")
    model = build_speech_llm(base, cache_dir=cache_dir, device=device, **spec["options"])
    for part in spec["adapters"]:
        state = load_file(str(folder / "adapters" / part / ADAPTER_FILE))
        state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
        result = set_peft_model_state_dict(getattr(model, part), state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{folder}/adapters/{part}: unexpected {result.unexpected_keys[:5]}")
    extra = load_file(str(folder / "extra.safetensors"))
    trainable = dict(trainable_state(model))
    for key, value in extra.items():
        if key in trainable:
            trainable[key] = value
    load_trainable(model, trainable, strict=True)
    with torch.no_grad():
        if model.ctc_head is not None:
            part = {k[len("ctc_head.") :]: v for k, v in extra.items() if k.startswith("ctc_head.")}
            if part:
                model.ctc_head.load_state_dict(part)
        model.connector.load_state_dict(
            {k[len("connector.") :]: v for k, v in extra.items() if k.startswith("connector.")}
        )
    if params_fingerprint(trainable_state(model)) != spec["fingerprint"]:
        raise ValueError(
            f"{folder}: the loaded trainable tensors differ from the saved model (fingerprint "
            "mismatch); the checkpoint is incomplete or was built with other options"
        )
    model.eval()
    return model

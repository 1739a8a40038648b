"""A seed checkpoint shipped with a recipe, loaded like a hub checkpoint.

The paper's method starts from downloaded checkpoints (Whisper, TinyLlama); a recipe whose tiny
stand-in is pretrained on a public split can ship that seed instead, so a user's run neither
synthesises the public split nor spends minutes pretraining, and round 0 is the same on every
machine. A shipped seed is a folder in the recipe holding two files:

- ``seed.safetensors``: the pretrained tensors in float16 (a few MB);
- ``seed.json``: the file's SHA-256, its dtype, the **settings** it was built with (everything
  that shapes the weights: the model config's tag, prompt, frame stacking, pretraining steps,
  the public split's options, ...) and facts about the build (final losses, the command).

:func:`shipped_seed_folder` serves it when a run's settings equal the shipped ones: the file's
SHA-256 is checked (a mismatch is an error naming the file and both digests: a damaged or
edited seed would silently change every figure measured from it), the tensors are cast to
float32 and handed to the recipe's ``materialise`` callback, which writes an ordinary
checkpoint folder into the cache (once per digest; :func:`speechbrain_fl.utils.atomic
.atomic_folder`). When the settings differ it returns ``None`` after one log line naming the
first keys that differ, and the recipe pretrains locally (:func:`speechbrain_fl.recipe
.cached_seed_model`). :func:`write_shipped_seed` writes the two files (the recipe's rebuild
script calls it).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from speechbrain_fl.recipe.seed_model import file_digest
from speechbrain_fl.utils.atomic import atomic_folder

__all__ = [
    "MANIFEST",
    "TENSORS",
    "ShippedSeedError",
    "settings_differences",
    "shipped_seed_folder",
    "shipped_seed_serves",
    "write_shipped_seed",
]

logger = logging.getLogger(__name__)

MANIFEST = "seed.json"
TENSORS = "seed.safetensors"


class ShippedSeedError(ValueError):
    """The shipped seed's file does not match its manifest (damaged, edited or missing)."""


def _normal(value: Any) -> Any:
    """A JSON round trip: tuples become lists, keys strings, so settings compare as stored."""
    return json.loads(json.dumps(value, sort_keys=True))


def settings_differences(shipped: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ between two settings mappings, as ``key: shipped -> run``.

    Example
    -------
    >>> settings_differences({"k": 2, "steps": [1, 2]}, {"k": 2, "steps": (1, 2)})
    []
    >>> settings_differences({"k": 2}, {"k": 4, "prompt": "x"})
    ['k: 2 -> 4', 'prompt: (absent) -> x']
    """
    shipped, wanted = _normal(dict(shipped)), _normal(dict(wanted))
    out = []
    for key in sorted(set(shipped) | set(wanted)):
        a, b = shipped.get(key, "(absent)"), wanted.get(key, "(absent)")
        if a != b:
            out.append(f"{key}: {a} -> {b}")
    return out


def shipped_seed_serves(
    folder: str | os.PathLike, settings: Mapping[str, Any], *, log=True
) -> bool:
    """Whether ``folder`` holds a shipped seed built with ``settings``.

    No ``seed.json``: ``False``. Other settings: ``False`` and (``log``) one log line naming
    the first keys that differ, shipped value -> this run's.
    """
    manifest_path = Path(folder) / MANIFEST
    if not manifest_path.is_file():
        return False
    differences = settings_differences(json.loads(manifest_path.read_text())["settings"], settings)
    if differences and log:
        logger.info(
            "The shipped seed model (%s) was built with other settings (%s%s): the seed is "
            "pretrained locally",
            folder,
            "; ".join(differences[:3]),
            f"; {len(differences) - 3} more" if len(differences) > 3 else "",
        )
    return not differences


def write_shipped_seed(
    folder: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    settings: Mapping[str, Any],
    facts: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``seed.safetensors`` (``tensors`` in float16) and ``seed.json`` into ``folder``.

    Returns the manifest written: ``file``, ``sha256`` (of the safetensors file's bytes),
    ``dtype``, ``settings`` and ``facts``.

    Example
    -------
    >>> tmp = getfixture("tmp_path")
    >>> m = write_shipped_seed(tmp, {"w": torch.ones(2)}, settings={"k": 2})
    >>> m["dtype"], len(m["sha256"]), sorted(p.name for p in tmp.iterdir())
    ('float16', 64, ['seed.json', 'seed.safetensors'])
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    half = {k: v.detach().cpu().to(torch.float16).contiguous() for k, v in tensors.items()}
    save_file(half, folder / TENSORS)
    manifest = {
        "file": TENSORS,
        "sha256": file_digest(folder / TENSORS),
        "dtype": "float16",
        "settings": _normal(dict(settings)),
        "facts": _normal(dict(facts or {})),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def shipped_seed_folder(
    folder: str | os.PathLike,
    *,
    settings: Mapping[str, Any],
    cache_folder: str | os.PathLike,
    prefix: str,
    materialise: Callable[[dict[str, torch.Tensor], Path], Any],
    marker: str,
    rebuild_hint: str = "",
) -> str | None:
    """The cache folder of the shipped seed when it serves ``settings``; ``None`` when not
    (:func:`shipped_seed_serves`, silent here).

    Arguments
    ---------
    folder : str or PathLike
        The recipe's shipped-seed folder (``seed.json`` and ``seed.safetensors``). No
        ``seed.json``: ``None``, nothing logged.
    settings : mapping
        This run's settings, compared key by key with the manifest's (JSON-normalised).
    cache_folder, prefix : str
        The checkpoint is materialised once into ``<cache_folder>/<prefix>_<sha256[:10]>``.
    materialise : callable
        ``materialise(tensors, folder)`` writes a loadable checkpoint of the float32
        ``tensors`` into ``folder`` (a temporary folder renamed when it returns).
    marker : str
        A file every finished checkpoint folder holds (its presence means "materialised").
    rebuild_hint : str
        Appended to the checksum error (the recipe's rebuild command).

    Raises
    ------
    ShippedSeedError
        The tensors file is missing or its SHA-256 is not the manifest's.
    """
    folder = Path(folder)
    if not shipped_seed_serves(folder, settings, log=False):
        return None
    manifest_path = folder / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    tensors_path = folder / manifest["file"]
    if not tensors_path.is_file():
        raise ShippedSeedError(f"{tensors_path}: missing (named by {manifest_path}){rebuild_hint}")
    digest = file_digest(tensors_path)
    if digest != manifest["sha256"]:
        raise ShippedSeedError(
            f"{tensors_path}: sha256 {digest} does not match {manifest['sha256']} in "
            f"{manifest_path}: the shipped seed was damaged or edited; restore both files "
            f"from the repository{rebuild_hint}"
        )
    target = Path(cache_folder) / f"{prefix}_{digest[:10]}"
    if (target / marker).is_file():
        logger.info("Using the shipped seed model (%s, in %s)", folder, target)
        return str(target)
    tensors = {k: v.to(torch.float32) for k, v in load_file(tensors_path).items()}
    with atomic_folder(target) as tmp:
        materialise(tensors, Path(tmp))
    logger.info("Using the shipped seed model (%s, sha256 %s...)", folder, digest[:10])
    return str(target)

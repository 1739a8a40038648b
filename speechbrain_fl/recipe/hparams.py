"""Hyperparameters of a recipe run: the file lookup, layered method files, ``--debug`` sizes.

A recipe keeps one ``hparams/base.yaml`` holding every key, and one short file per method
(``fedavg.yaml``, ``alpha_split.yaml``, ...) holding only what the method changes. HyperPyYAML's
``!include`` inserts a file *under a key*, so it cannot express "this file, on top of that one";
instead a method file is plain YAML applied as overrides on the base. The layers, lowest first:

1. ``base.yaml`` (next to the method file);
2. ``<preset_dir>/<preset>.yaml`` when the base's ``preset_key`` (e.g. ``model``) names a preset
   that has one (the paper's settings for real models);
3. the method file;
4. command-line overrides (``--number_of_rounds 3``).

The merged overrides are applied with ``overrides_must_match=True``, so a typo in a method file
or on the command line fails with the unknown key named, before anything heavy starts. A file
that has no ``base.yaml`` beside it is loaded as a plain HyperPyYAML file.

The one lookup of an hparams path (:func:`resolve_hparams_path`): the working directory first,
then the recipe folder, then the app root (the repository, where ``flwr run`` starts), so
``python recipes/MLS/train_fl.py hparams/flat.yaml`` works from the repository root and from
``recipes/MLS/``. :func:`shrink_for_debug` applies a recipe's ``--debug`` sizes (SpeechBrain's
``--debug``: a run of seconds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from hyperpyyaml import load_hyperpyyaml

__all__ = ["APP_ROOT", "load_layered_hparams", "resolve_hparams_path", "shrink_for_debug"]

# The folder holding the ``speechbrain_fl`` package and ``pyproject.toml`` (Flower's app root).
APP_ROOT = Path(__file__).resolve().parents[2]
BASE_NAME = "base.yaml"


def resolve_hparams_path(path: str | os.PathLike, *, recipe_dir: str | os.PathLike) -> Path:
    """Find an hparams file: the working directory, then the recipe folder, then the app root.

    Arguments
    ---------
    path : str or PathLike
        As given on the command line (e.g. ``hparams/alpha_split.yaml``).
    recipe_dir : str or PathLike
        The recipe's folder (where ``train*.py`` lives).

    Returns
    -------
    Path
        An existing file.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "hparams").mkdir()
    >>> _ = (d / "hparams" / "x.yaml").write_text("a: 1")
    >>> resolve_hparams_path("hparams/x.yaml", recipe_dir=d).name
    'x.yaml'
    """
    candidates = [Path(path), Path(recipe_dir) / path, APP_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"hparams file {str(path)!r} not found (tried {tried})")


def _read_plain_yaml(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of hyperparameters, got {type(values)}")
    return values


def _parse_overrides(overrides: str | dict | None) -> dict[str, Any]:
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    values = yaml.safe_load(overrides) or {}
    if not isinstance(values, dict):
        raise ValueError(f"command-line overrides must be key: value pairs, got {overrides!r}")
    return values


def load_layered_hparams(
    hparams_file: str | os.PathLike,
    overrides: str | dict | None = None,
    *,
    recipe_dir: str | os.PathLike,
    preset_key: str = "model",
    preset_dir: str = "models",
) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """Load a method file on top of its ``base.yaml`` (see the module docstring).

    Arguments
    ---------
    hparams_file : str or PathLike
        The method file given on the command line.
    overrides : str or dict, optional
        Command-line overrides (``sb.parse_arguments`` returns them as a YAML string).
    recipe_dir : str or PathLike
        Recipe folder, to resolve ``hparams_file`` from any working directory.
    preset_key, preset_dir : str
        Key naming the preset and the folder (next to the base) holding ``<preset>.yaml``.

    Returns
    -------
    tuple
        ``(hparams, base_path, merged_overrides)``: the loaded hparams, the file that was
        loaded (to copy into the output folder), and the overrides applied to it.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "base.yaml").write_text("method: none\\nclip: null\\nout: !ref r/<method>")
    >>> _ = (d / "flat.yaml").write_text("method: flat\\nclip: 1.0")
    >>> hp, _, _ = load_layered_hparams(d / "flat.yaml", "clip: 2.0", recipe_dir=d)
    >>> hp["out"], hp["clip"]
    ('r/flat', 2.0)
    """
    path = resolve_hparams_path(hparams_file, recipe_dir=recipe_dir)
    cli = _parse_overrides(overrides)
    base = path.with_name(BASE_NAME)
    if not base.is_file() or base == path:
        with open(path, encoding="utf-8") as handle:
            return load_hyperpyyaml(handle, cli), path, cli
    method = _read_plain_yaml(path)
    base_values = _top_level_scalars(base)
    unknown = sorted(set(method) - set(base_values))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; every key must exist in {base}")
    preset = cli.get(preset_key, method.get(preset_key, base_values.get(preset_key)))
    merged: dict[str, Any] = {}
    if preset is not None:
        preset_file = base.parent / preset_dir / f"{preset}.yaml"
        if preset_file.is_file():
            merged.update(_read_plain_yaml(preset_file))
    merged.update(method)
    merged.update(cli)
    unknown = sorted(set(cli) - set(base_values))
    if unknown:
        raise ValueError(f"command-line override(s) {unknown} are not keys of {base}")
    with open(base, encoding="utf-8") as handle:
        hparams = load_hyperpyyaml(handle, merged)
    return hparams, base, merged


def _top_level_scalars(path: Path) -> dict[str, str | None]:
    """Top-level keys of a HyperPyYAML file with their raw one-line values (tags not built)."""
    values: dict[str, str | None] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line and not line[0].isspace() and not line.startswith("#") and ":" in line:
                key, _, rest = line.partition(":")
                rest = rest.split(" #", 1)[0].strip()
                values[key.strip()] = rest or None
    return values


def shrink_for_debug(
    hparams: dict[str, Any],
    *,
    caps: Mapping[str, int | float] | None = None,
    values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Apply a recipe's ``--debug`` sizes in place: ``hparams[k] = min(hparams[k], cap)``.

    Arguments
    ---------
    hparams : dict
        The loaded hparams (changed in place and returned).
    caps : mapping, optional
        ``{key: cap}``: numbers that ``--debug`` lowers to at most ``cap`` (rounds, steps,
        resamples).
    values : mapping, optional
        ``{key: value}`` set as given (``measure_memory: False``).

    Returns
    -------
    dict
        ``hparams``.

    Raises
    ------
    KeyError
        Naming a key of ``caps`` or ``values`` that the hparams do not have.

    Example
    -------
    >>> shrink_for_debug({"rounds": 10, "steps": 3, "memory": True},
    ...                  caps={"rounds": 2, "steps": 4}, values={"memory": False})
    {'rounds': 2, 'steps': 3, 'memory': False}
    """
    for key, cap in (caps or {}).items():
        if key not in hparams:
            raise KeyError(f"--debug cap for {key!r}: not a key of the hparams")
        hparams[key] = min(cap, hparams[key])
    for key, value in (values or {}).items():
        if key not in hparams:
            raise KeyError(f"--debug value for {key!r}: not a key of the hparams")
        hparams[key] = value
    return hparams

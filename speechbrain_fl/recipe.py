"""Helpers every recipe script shares: hparams resolution, layered method files, run options.

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

SpeechBrain's run options (``sb.parse_arguments``: ``--device``, ``--precision``,
``--max_grad_norm``, ...) either work in a federated recipe or are refused:
:func:`federated_run_options` keeps those the user set that the federated loop and the seed
pretraining honour (:data:`SUPPORTED_RUN_OPTIONS`) and raises, naming the option and why, for
the others (:data:`REFUSED_RUN_OPTIONS`). :func:`split_overrides` separates run options from
hparams overrides when both arrive in one mapping (a ``flwr run --run-config``).

A federated recipe's task factory runs in several processes (the script or ServerApp, every
Ray actor or SuperNode); :func:`prepare_once` lets the first one prepare the data and the
others read what it prepared.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from hyperpyyaml import load_hyperpyyaml
from speechbrain.utils.run_opts import RunOptions

from speechbrain_fl.atomic import atomic_open

__all__ = [
    "REFUSED_RUN_OPTIONS",
    "SUPPORTED_RUN_OPTIONS",
    "federated_run_options",
    "load_layered_hparams",
    "prepare_once",
    "resolve_hparams_path",
    "split_overrides",
]

# Run options a federated recipe honours: passed to every Brain (clients' local training,
# server and test evaluation) and to the seed pretraining where they apply.
SUPPORTED_RUN_OPTIONS = (
    "debug",
    "debug_batches",
    "debug_epochs",
    "device",
    "precision",
    "eval_precision",
    "auto_mix_prec",
    "bfloat16_mix_prec",
    "max_grad_norm",
    "skip_nonfinite_grads",
    "nonfinite_patience",
    "noprogressbar",
    "grad_accumulation_factor",
    "tqdm_colored_bar",
    "tqdm_barcolor",
    "log_config",
)
# Run options a federated recipe cannot honour, with the reason given to the user.
REFUSED_RUN_OPTIONS = {
    "test_only": "the federated recipe always trains; evaluate a saved model with its own script",
    "debug_persistently": "debug runs write no Brain checkpoints; the engine state resumes",
    "data_parallel_backend": "the engine parallelises clients (Ray actors / SuperNodes), not batches",
    "data_parallel_count": "the engine parallelises clients (Ray actors / SuperNodes), not batches",
    "distributed_launch": "the engine parallelises clients (Ray actors / SuperNodes), not batches",
    "distributed_backend": "the engine parallelises clients (Ray actors / SuperNodes), not batches",
    "find_unused_parameters": "DDP is not used by the federated loop",
    "jit": "a process shares one model among its clients; compile it in the recipe instead",
    "jit_module_keys": "a process shares one model among its clients",
    "compile": "a process shares one model among its clients; compile it in the recipe instead",
    "compile_module_keys": "a process shares one model among its clients",
    "compile_mode": "a process shares one model among its clients",
    "compile_using_fullgraph": "a process shares one model among its clients",
    "compile_using_dynamic_shape_tracing": "a process shares one model among its clients",
    "ckpt_interval_minutes": "the engine checkpoints after every round (server_state.pt)",
    "ckpt_interval_steps": "the engine checkpoints after every round (server_state.pt)",
    "optimizer_step_limit": "a client's Brain is reused across rounds; limit local_epochs instead",
    "remove_vector_weight_decay": "the recipe's Brain builds its own AdamW parameter groups",
    "profile_training": "profile one client's brain.fit outside the engine",
    "profile_warmup": "profile one client's brain.fit outside the engine",
    "profile_steps": "profile one client's brain.fit outside the engine",
}

BASE_NAME = "base.yaml"


def resolve_hparams_path(path: str | os.PathLike, *, recipe_dir: str | os.PathLike) -> Path:
    """Find an hparams file relative to the working directory, then to the recipe folder.

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
    candidates = [Path(path), Path(recipe_dir) / path]
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


def federated_run_options(run_opts: Any) -> dict[str, Any]:
    """The run options the user set, checked for a federated recipe.

    Arguments
    ---------
    run_opts : RunOptions or dict
        What ``sb.parse_arguments`` returns (only its ``overridden_args`` count: an option left
        at its default is not "set"), or a plain dict of options that were set.

    Returns
    -------
    dict
        ``{option: value}`` for the supported options the user set, ready for a Brain's
        ``run_opts`` (SpeechBrain then lets them win over the same keys in the hparams).

    Raises
    ------
    ValueError
        Naming each refused or unknown option and why.

    Example
    -------
    >>> federated_run_options({"device": "cpu", "max_grad_norm": 1.0})
    {'device': 'cpu', 'max_grad_norm': 1.0}
    >>> federated_run_options({"compile": True})
    Traceback (most recent call last):
    ...
    ValueError: run option --compile is not supported by the federated recipe: a process shares one model among its clients; compile it in the recipe instead
    """
    if isinstance(run_opts, RunOptions):
        given = {k: getattr(run_opts, k) for k in sorted(run_opts.overridden_args)}
    else:
        given = dict(run_opts)
    given.pop("param_file", None)
    problems = []
    for key in given:
        if key in REFUSED_RUN_OPTIONS:
            problems.append(
                f"run option --{key} is not supported by the federated recipe: "
                f"{REFUSED_RUN_OPTIONS[key]}"
            )
        elif key not in SUPPORTED_RUN_OPTIONS:
            problems.append(f"unknown run option --{key}")
    if problems:
        raise ValueError("; ".join(problems))
    return given


def split_overrides(overrides: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """Split ``{key: value}`` into (hparams overrides, run options); hyphens read as underscores.

    Example
    -------
    >>> split_overrides({"number-of-rounds": 2, "debug": True})
    ({'number_of_rounds': 2}, {'debug': True})
    """
    names = set(SUPPORTED_RUN_OPTIONS) | set(REFUSED_RUN_OPTIONS)
    hparams: dict[str, Any] = {}
    run_opts: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        key = key.replace("-", "_")
        (run_opts if key in names else hparams)[key] = value
    return hparams, run_opts


PREPARED_FILE = "prepared.json"


def prepare_once(
    folder: str | os.PathLike, key: Mapping[str, Any], prepare: Callable[[], Any]
) -> Any:
    """Return ``prepare()``'s JSON result, computed once per ``key`` and kept in ``folder``.

    The first caller runs ``prepare`` (corpus, manifests, partition, seed model: idempotent,
    cached steps) and writes ``<folder>/prepared.json`` atomically with ``key``; a later caller
    with the same ``key`` reads it and prepares nothing, so the processes of one run (the script
    or the ServerApp first, then Ray actors or SuperNodes) never rewrite files another process
    is reading. A different ``key`` (a changed option) prepares again.

    Example
    -------
    >>> import tempfile
    >>> d, calls = tempfile.mkdtemp(), []
    >>> def prep():
    ...     calls.append(1)
    ...     return {"clients": 4}
    >>> prepare_once(d, {"seed": 1}, prep), prepare_once(d, {"seed": 1}, prep), len(calls)
    ({'clients': 4}, {'clients': 4}, 1)
    """
    key = json.loads(json.dumps(dict(key), default=str))
    marker = Path(folder) / PREPARED_FILE
    if marker.is_file():
        saved = json.loads(marker.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return saved["result"]
    result = prepare()
    with atomic_open(marker) as handle:
        json.dump({"key": key, "result": result}, handle, indent=2)
    return result

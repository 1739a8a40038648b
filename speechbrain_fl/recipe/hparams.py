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

A ``method`` given by name (``--method flat``) is built as its registered class
(:func:`resolve_method`), as a method file's ``!new:`` builds it.

The merged overrides are applied with ``overrides_must_match=True``, so a typo in a method file
or on the command line fails with the unknown key named, before anything heavy starts. A file
that has no ``base.yaml`` beside it is loaded as a plain HyperPyYAML file.

The one lookup of an hparams path (:func:`resolve_hparams_path`): the working directory first,
then the recipe folder, then the app root (the repository, where ``flwr run`` starts), so
``python recipes/MLS/train_fl.py hparams/flat.yaml`` works from the repository root and from
``recipes/MLS/``.

``--debug`` (SpeechBrain's: a run of seconds) is :func:`load_run_hparams`: the hparams' plain
values are read (every ``!ref`` resolved, no object built), the recipe's debug sizes (:func:`debug_overrides`: caps on rounds and steps, a small
generated corpus, and ``<folder>_debug`` for ``output_folder`` and ``cache_folder`` unless the
command line names them) become
command-line overrides, and the file is loaded with them. So every ``!ref`` follows (the
save folder, the train log, a logger's file), a debug run never writes into the real run's
output folder or corpus cache (the small corpus gets its own cache), and the ``hyperparams.yaml``
SpeechBrain saves shows the values the run used. :func:`shrink_for_debug` applies the same sizes
in place, for a dict that is not reloaded.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import ruamel.yaml
import yaml
from hyperpyyaml import load_hyperpyyaml, resolve_references
from ruamel.yaml.representer import RoundTripRepresenter

from speechbrain_fl.utils.logging import quiet_recipe_logs

__all__ = [
    "APP_ROOT",
    "DEBUG_FOLDERS",
    "DEBUG_SUFFIX",
    "debug_folder",
    "debug_overrides",
    "load_layered_hparams",
    "load_run_hparams",
    "resolve_hparams_path",
    "resolve_method",
    "shrink_for_debug",
]

# The folder holding the ``speechbrain_fl`` package and ``pyproject.toml`` (Flower's app root).
APP_ROOT = Path(__file__).resolve().parents[2]
BASE_NAME = "base.yaml"
# Folders a --debug run moves to ``<folder>_debug``: its outputs and its (small) corpus cache.
DEBUG_FOLDERS = ("output_folder", "cache_folder")
DEBUG_SUFFIX = "_debug"


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


class HyperText(str):
    """A layer's HyperPyYAML-tagged value (``!name:``, ``!new:``, ``!ref`` ...) as its source
    text. It replaces the base's entry of its key whole (a model preset swapping the
    ``opt_class`` object, a method file building its ``method`` object), where a plain override
    would be merged into it. Written out (SpeechBrain's saved ``hyperparams.yaml``, whose
    overrides are the merged layers) it is that tagged YAML again, so the file stays loadable."""


def _represent_hypertext(representer, value: HyperText):
    """ruamel's node of a :class:`HyperText`: its text parsed as the value of a key."""
    return ruamel.yaml.YAML().compose(f"value: {value}").value[0][1]


RoundTripRepresenter.add_representer(HyperText, _represent_hypertext)


_TAGS = ("!new:", "!name:", "!apply:", "!ref ", "!copy ", "!tuple ", "!include:")


def _read_plain_yaml(path: Path) -> dict[str, Any]:
    """A layer file's values: plain YAML, a tagged value kept as :class:`HyperText`."""
    text = Path(path).read_text(encoding="utf-8")

    class Loader(yaml.SafeLoader):
        pass

    def tagged(loader, suffix, node):
        raw = text[node.start_mark.index : node.end_mark.index].rstrip().splitlines()
        while raw and raw[-1].lstrip().startswith("#"):
            raw.pop()  # a comment after the value belongs to the next key
        return HyperText("\n".join(raw).rstrip())

    Loader.add_multi_constructor("!", tagged)
    try:
        values = yaml.load(text, Loader=Loader) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of hyperparameters, got {type(values)}")
    return values


def _layered_source(source: Path, merged: dict[str, Any]):
    """``(stream, plain overrides)``: the base with each :class:`HyperText` layer value put in
    place of its key's entry, and the other overrides (applied by HyperPyYAML)."""
    tagged = {k: v for k, v in merged.items() if isinstance(v, HyperText)}
    plain = {k: v for k, v in merged.items() if k not in tagged}
    if not tagged:
        return open(source, encoding="utf-8"), plain
    lines, out, skipping = source.read_text(encoding="utf-8").splitlines(), [], False
    for line in lines:
        top = line[:1].strip() != ""  # column 0: a key or a comment ends the replaced entry
        skipping = skipping and not top
        key = line.split(":", 1)[0] if top and not line.startswith("#") else None
        if key in tagged:
            out.append(f"{key}: {tagged.pop(key)}")
            skipping = True
        elif not skipping:
            out.append(line)
    if tagged:
        raise ValueError(f"override(s) {sorted(tagged)} are not keys of {source}")
    return io.StringIO("\n".join(out) + "\n"), plain


def _parse_overrides(overrides: str | dict | None) -> dict[str, Any]:
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    values = yaml.safe_load(overrides) or {}
    if not isinstance(values, dict):
        raise ValueError(f"command-line overrides must be key: value pairs, got {overrides!r}")
    return values


def _recipe_modules_importable(recipe_dir: str | os.PathLike) -> None:
    """Put the recipe folder on ``sys.path``, as running its script does, so its hparams can
    build objects of the recipe's own modules (``!new:<module>.<Class>``) from any caller."""
    folder = str(Path(recipe_dir).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)


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
    _recipe_modules_importable(recipe_dir)
    source, merged = _layers(
        hparams_file, overrides, recipe_dir=recipe_dir, preset_key=preset_key, preset_dir=preset_dir
    )
    stream, plain = _layered_source(source, merged)
    with stream as handle:
        hparams = load_hyperpyyaml(handle, plain)
    return resolve_method(hparams, source), source, merged


def resolve_method(hparams: dict[str, Any], source: Any = None) -> dict[str, Any]:
    """``method`` given by name (``--method flat``, a run config's ``method="flat"``) becomes
    the registered class built from the hparams' privacy keys, as the YAML's ``!new:`` builds
    it; so a recipe and the engine only ever see a
    :class:`~speechbrain_fl.privacy.methods.PrivacyMethod`. In place; returns ``hparams``.

    Example
    -------
    >>> resolve_method({"method": "flat", "clip": 2.0, "noise_multiplier": 0.5})["method"]
    Flat(clip=2.0, noise_multiplier=0.5)
    """
    method = hparams.get("method")
    if isinstance(method, str):
        from speechbrain_fl.privacy.methods import privacy_method

        try:
            hparams["method"] = privacy_method(method, **hparams)
        except ValueError as err:
            raise ValueError(f"{source}: {err}" if source else str(err)) from None
    return hparams


def _layers(hparams_file, overrides, *, recipe_dir, preset_key="model", preset_dir="models"):
    """``(file to load, merged overrides)`` of :func:`load_layered_hparams` (nothing built)."""
    path = resolve_hparams_path(hparams_file, recipe_dir=recipe_dir)
    cli = {  # a tagged value sent on as text (a task spec's overrides) stays one
        k: HyperText(v) if isinstance(v, str) and v.startswith(_TAGS) else v
        for k, v in _parse_overrides(overrides).items()
    }
    base = path.with_name(BASE_NAME)
    if not base.is_file() or base == path:
        return path, cli
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
    return base, merged


class _PlainLoader(yaml.SafeLoader):
    """YAML loader that reads HyperPyYAML's ``!new:``/``!name:``/``!apply:`` nodes as ``None``."""


_PlainLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _plain_hparams(hparams_file, overrides, **kwargs) -> dict[str, Any]:
    """The hparams' plain values with every ``!ref`` resolved and no object built (no
    ``__set_seed``, no logger opening its folder): what ``--debug`` computes its sizes from."""
    source, merged = _layers(hparams_file, overrides, **kwargs)
    stream, plain = _layered_source(source, merged)
    with stream as handle:
        text = resolve_references(handle, plain, overrides_must_match=True).getvalue()
    return yaml.load(text, Loader=_PlainLoader) or {}


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


def _cap(key: str, value: Any, cap: Any) -> Any:
    """``value`` lowered to ``cap``: a number to ``min``, a list to its first ``cap`` items, a
    mapping key by key (a key the mapping lacks gets the cap: the generator's default is
    larger)."""
    if isinstance(cap, Mapping):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise TypeError(f"--debug cap for {key!r}: a mapping cap for a {type(value).__name__}")
        capped = dict(value)
        for sub, sub_cap in cap.items():
            capped[sub] = _cap(f"{key}.{sub}", value[sub], sub_cap) if sub in value else sub_cap
        return capped
    if isinstance(value, (list, tuple)):
        if not isinstance(cap, int):
            raise TypeError(f"--debug cap for {key!r}: a list is capped by an item count")
        return list(value[:cap])
    if value is None:  # unbounded (e.g. max_utts_per_split: null)
        return cap
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # e.g. --number_of_rounds=abc: named here, not a bare TypeError from min()
        raise ValueError(f"{key}: {value!r} must be a number")
    return min(cap, value)


def shrink_for_debug(
    hparams: dict[str, Any],
    *,
    caps: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Apply a recipe's ``--debug`` sizes in place: ``hparams[k] = min(hparams[k], cap)``.

    Arguments
    ---------
    hparams : dict
        The loaded hparams (changed in place and returned).
    caps : mapping, optional
        ``{key: cap}``: values that ``--debug`` lowers to at most ``cap``: a number to
        ``min(value, cap)`` (``null`` to ``cap``), a list to its first ``cap`` items, a mapping
        key by key with a mapping cap (a missing key is set to its cap); a callable cap is
        called with the hparams first (a cap that depends on another key, e.g. the task).
    values : mapping, optional
        ``{key: value}`` set as given (``measure_memory: False``); a callable value is called
        with the hparams (a value that depends on another key, e.g. the task).

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
    >>> shrink_for_debug({"rounds": 10, "steps": 3, "memory": True, "langs": ["en", "de", "fr"],
    ...                   "corpus": {"speakers": 96}},
    ...                  caps={"rounds": 2, "steps": 4, "langs": 2,
    ...                        "corpus": {"speakers": 4, "repeats": 1}},
    ...                  values={"memory": False})
    {'rounds': 2, 'steps': 3, 'memory': False, 'langs': ['en', 'de'], 'corpus': {'speakers': 4, 'repeats': 1}}
    """  # noqa: E501
    for key, cap in (caps or {}).items():
        if key not in hparams:
            raise KeyError(f"--debug cap for {key!r}: not a key of the hparams")
        hparams[key] = _cap(key, hparams[key], cap(hparams) if callable(cap) else cap)
    for key, value in (values or {}).items():
        if key not in hparams:
            raise KeyError(f"--debug value for {key!r}: not a key of the hparams")
        hparams[key] = value(hparams) if callable(value) else value
    return hparams


def debug_folder(path: str | os.PathLike) -> str:
    """The ``--debug`` twin of a folder: ``<path>_debug`` (unchanged when it already is one).

    Example
    -------
    >>> debug_folder("results/MLS/tiny/fedavg/1234"), debug_folder("results/x_debug")
    ('results/MLS/tiny/fedavg/1234_debug', 'results/x_debug')
    """
    text = os.fspath(path).rstrip("/\\")
    return text if text.endswith(DEBUG_SUFFIX) else text + DEBUG_SUFFIX


def debug_overrides(
    hparams: Mapping[str, Any],
    *,
    caps: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
    folders: tuple[str, ...] = DEBUG_FOLDERS,
    given: Collection[str] = (),
) -> dict[str, Any]:
    """The ``--debug`` sizes of loaded hparams as overrides (to load the file again with).

    Arguments
    ---------
    hparams : mapping
        The hparams as loaded without the debug sizes.
    caps, values : mapping, optional
        As in :func:`shrink_for_debug`.
    folders : tuple of str
        Keys moved to :func:`debug_folder` (those the hparams have and set to a path).
    given : collection of str
        Keys the user set on the command line: a folder named there is the user's choice and
        stays as given (``--output_folder /tmp/x --debug`` writes to ``/tmp/x``).

    Returns
    -------
    dict
        ``{key: debug value}`` for every key of ``caps``, ``values`` and ``folders``.

    Example
    -------
    >>> debug_overrides({"rounds": 10, "output_folder": "results/r", "other": 1},
    ...                 caps={"rounds": 2})
    {'rounds': 2, 'output_folder': 'results/r_debug'}
    """
    shrunk = shrink_for_debug(dict(hparams), caps=caps, values=values)
    overrides = {key: shrunk[key] for key in [*(caps or {}), *(values or {})]}
    for key in folders:
        if key not in given and isinstance(hparams.get(key), (str, os.PathLike)):
            overrides[key] = debug_folder(hparams[key])
    return overrides


def load_run_hparams(
    hparams_file: str | os.PathLike,
    overrides: str | dict | None = None,
    *,
    recipe_dir: str | os.PathLike,
    debug: bool = False,
    debug_caps: Mapping[str, Any] | None = None,
    debug_values: Mapping[str, Any] | None = None,
    defaults: Callable[[dict[str, Any]], None] | None = None,
    **layer_kwargs: Any,
) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """:func:`load_layered_hparams`, then ``defaults(hparams)``; under ``--debug``, loaded
    with :func:`debug_overrides` (see the module docstring).

    Every process of a run starts here, so it also makes the process's logs readable
    (:func:`speechbrain_fl.utils.logging.quiet_recipe_logs`).

    Arguments
    ---------
    hparams_file, overrides, recipe_dir :
        As in :func:`load_layered_hparams` (``layer_kwargs`` too).
    debug : bool
        SpeechBrain's ``--debug`` run option.
    debug_caps, debug_values : mapping, optional
        The recipe's debug sizes (:func:`shrink_for_debug`).
    defaults : callable, optional
        ``defaults(hparams)`` fills values derived from others (e.g. rounds from the corpus),
        before the debug sizes.

    Returns
    -------
    tuple
        ``(hparams, base_path, merged_overrides)``; under ``--debug`` the merged overrides hold
        the debug values, so the saved ``hyperparams.yaml`` shows them.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "base.yaml").write_text(
    ...     "rounds: 10\\noutput_folder: r/x\\nsave_folder: !ref <output_folder>/save")
    >>> _ = (d / "m.yaml").write_text("rounds: 8")
    >>> hp, _, merged = load_run_hparams(d / "m.yaml", recipe_dir=d, debug=True,
    ...                                  debug_caps={"rounds": 2})
    >>> hp["rounds"], hp["save_folder"], merged
    (2, 'r/x_debug/save', {'rounds': 2, 'output_folder': 'r/x_debug'})
    """
    quiet_recipe_logs()  # every process of a run loads its hparams here
    cli = {  # a tagged value sent on as text (a task spec's overrides) stays one
        k: HyperText(v) if isinstance(v, str) and v.startswith(_TAGS) else v
        for k, v in _parse_overrides(overrides).items()
    }
    if not debug:
        hparams, base, merged = load_layered_hparams(
            hparams_file, cli, recipe_dir=recipe_dir, **layer_kwargs
        )
        if defaults is not None:
            defaults(hparams)
        return hparams, base, merged
    # the sizes from the plain values: nothing is built with the real run's folders (a
    # TensorBoard logger would create its directory there), no seed line twice
    plain = _plain_hparams(hparams_file, cli, recipe_dir=recipe_dir, **layer_kwargs)
    if defaults is not None:
        defaults(plain)
    extra = debug_overrides(plain, caps=debug_caps, values=debug_values, given=cli)
    hparams, base, merged = load_layered_hparams(
        hparams_file, {**cli, **extra}, recipe_dir=recipe_dir, **layer_kwargs
    )
    if defaults is not None:
        defaults(hparams)
    # values that defaults() derived again (e.g. rounds from null) get their caps once more
    shrink_for_debug(hparams, caps=debug_caps)
    return hparams, base, merged

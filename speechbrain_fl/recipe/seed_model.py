"""The cached seed model: a starting checkpoint built once per options and kept in the cache.

A recipe whose embedded default starts from a tiny random model pretrains it centrally on a
public split before the federated stage. That takes minutes; a second run with the same options
reuses it. :func:`cached_seed_model` owns the three steps every recipe repeats:

1. the **key**: a mapping of everything that shapes the weights (steps, learning rate, seed,
   the public split's content hash, ...), hashed to a short tag (:func:`cache_tag`);
2. the **build**: called only when ``<cache_folder>/<prefix>_<tag>/`` holds no finished model;
3. the **save**: the build writes into a temporary folder that appears under the final name
   whole or not at all (:func:`speechbrain_fl.utils.atomic.atomic_folder`), so a killed pretraining
   never leaves a half-saved model that a later run would load.

The pretraining loop itself is the model family's (``speechbrain_fl.models.pretrain``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from speechbrain_fl.utils.atomic import atomic_folder

__all__ = ["cache_tag", "cached_seed_model", "file_digest"]

logger = logging.getLogger(__name__)


def cache_tag(key: Mapping[str, Any], *, length: int = 10) -> str:
    """The first ``length`` hex digits of SHA-256 over the key's sorted-keys JSON.

    Example
    -------
    >>> cache_tag({"steps": 2, "lr": 0.1}) == cache_tag({"lr": 0.1, "steps": 2})
    True
    >>> len(cache_tag({"steps": 2}))
    10
    """
    return hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:length]


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (a manifest's content joins a seed model's key)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cached_seed_model(
    *,
    cache_folder: str | os.PathLike,
    prefix: str,
    key: Mapping[str, Any],
    build: Callable[[Path], Any],
    marker: str,
) -> tuple[str, dict[str, float]]:
    """The folder of the seed model for ``key``, built by ``build`` the first time.

    Arguments
    ---------
    cache_folder : str or PathLike
        Where seed models are kept (the recipe's ``cache_folder``).
    prefix : str
        Folder name prefix (``seed_tiny``): the folder is ``<prefix>_<cache_tag(key)>``.
    key : mapping
        Everything that shapes the weights (JSON-serialisable).
    build : callable
        ``build(folder)`` trains the model and saves it into ``folder`` (a temporary folder
        that becomes the final one when ``build`` returns).
    marker : str
        A file every finished model folder holds (``config.json``): its presence means "built".

    Returns
    -------
    tuple
        ``(folder, timings)``: ``timings`` is ``{"pretraining": seconds}`` when this call built
        the model, ``{}`` when it reused one.

    Example
    -------
    >>> import tempfile
    >>> d, calls = tempfile.mkdtemp(), []
    >>> def build(folder):
    ...     calls.append(1)
    ...     (folder / "config.json").write_text("{}")
    >>> a, t = cached_seed_model(cache_folder=d, prefix="seed", key={"s": 1}, build=build,
    ...                          marker="config.json")
    >>> b, _ = cached_seed_model(cache_folder=d, prefix="seed", key={"s": 1}, build=build,
    ...                          marker="config.json")
    >>> a == b, len(calls), sorted(t)
    (True, 1, ['pretraining'])
    """
    folder = Path(cache_folder) / f"{prefix}_{cache_tag(key)}"
    if (folder / marker).is_file():
        logger.info("Reusing the pretrained seed model in %s", folder)
        return str(folder), {}
    start = time.time()
    with atomic_folder(folder) as tmp:
        build(Path(tmp))
    return str(folder), {"pretraining": time.time() - start}

"""The stamp file of a generated corpus: reuse the folder when it was made with the same options.

Every embedded corpus (``mls_synth``, ``common_voice_synth``, ``superb_synth``) is generated
into one folder through :func:`speechbrain_fl.utils.atomic.atomic_folder`, with a JSON stamp file
``{"options": ..., "seconds": ..., "summary": ...}`` written last. A later run with the same
options reuses the folder; other options regenerate it.
"""

from __future__ import annotations

import json
import logging
import os

__all__ = ["cached_stamp"]

logger = logging.getLogger(__name__)


def cached_stamp(out_dir: str, stamp_file: str, options: dict, *, name: str) -> dict | None:
    """The stamp of the corpus in ``out_dir`` if it was made with ``options``, else ``None``.

    Arguments
    ---------
    out_dir : str
        Absolute path of the corpus folder.
    stamp_file : str
        Name of the stamp file inside it.
    options : dict
        The options the caller would generate the corpus with (JSON types).
    name : str
        The corpus's name, for the log lines.

    Returns
    -------
    dict or None
        ``{**stamp, "path": out_dir, "cached": True}``, or ``None`` when the folder has no
        stamp or one made with other options (logged: it will be regenerated).

    Example
    -------
    >>> folder = str(getfixture("tmp_path"))
    >>> cached_stamp(folder, ".s.json", {"a": 1}, name="toy") is None
    True
    >>> with open(os.path.join(folder, ".s.json"), "w") as f:
    ...     json.dump({"options": {"a": 1}, "seconds": 0.1}, f)
    >>> cached_stamp(folder, ".s.json", {"a": 1}, name="toy")["cached"]
    True
    """
    stamp_path = os.path.join(out_dir, stamp_file)
    if not os.path.isfile(stamp_path):
        return None
    with open(stamp_path, encoding="utf-8") as handle:
        stamp = json.load(handle)
    if stamp.get("options") == options:
        logger.info("Embedded %s corpus found in %s (cached).", name, out_dir)
        return {**stamp, "path": out_dir, "cached": True}
    logger.info(
        "Embedded %s corpus in %s was made with other options: regenerating.", name, out_dir
    )
    return None

"""The teacher-output store: one file holding the teacher's logits on D_aux.

The teacher is queried once; its raw logits (not probabilities) are written here with the
record ids and class names, and this file is all the student ever sees of the teacher. The
temperature is applied when reading (``softmax(z / tau)``), so tau can change without a new
query. The file is an uncompressed NumPy ``.npz`` (``ids``, ``logits``, ``classes``, ``meta``
as a JSON string) written atomically.

Example
-------
>>> import numpy as np
>>> path = getfixture("tmp_path") / "aux_logits.npz"
>>> write_teacher_outputs(path, ids=["a", "b"], logits=np.array([[2.0, 0.0], [0.0, 0.0]]),
...                       classes=["male", "female"], meta={"epsilon": 1.0})
>>> out = read_teacher_outputs(path, temperature=2.0)
>>> out.ids, out.probs.round(3).tolist(), out.meta["epsilon"]
(['a', 'b'], [[0.731, 0.269], [0.5, 0.5]], 1.0)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from speechbrain_fl.atomic import atomic_open

__all__ = ["TeacherOutputs", "read_teacher_outputs", "write_teacher_outputs"]


@dataclass(frozen=True)
class TeacherOutputs:
    """Teacher logits on D_aux and their tempered probabilities."""

    ids: list[str]
    logits: np.ndarray
    probs: np.ndarray
    classes: list[str]
    temperature: float
    meta: dict = field(default_factory=dict)

    def aligned(self, ids: Sequence[str]) -> np.ndarray:
        """Probabilities in the order of ``ids`` (``KeyError`` naming a missing id)."""
        index = {k: i for i, k in enumerate(self.ids)}
        missing = [k for k in ids if k not in index]
        if missing:
            raise KeyError(f"{len(missing)} record(s) have no teacher output, e.g. {missing[:5]}")
        return self.probs[[index[k] for k in ids]]


def write_teacher_outputs(
    path: str | os.PathLike,
    *,
    ids: Sequence[str],
    logits: np.ndarray,
    classes: Sequence[str],
    meta: dict | None = None,
) -> None:
    """Write the teacher's logits (N, K) for records ``ids`` (atomically)."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2 or logits.shape != (len(ids), len(classes)):
        raise ValueError(f"logits must be ({len(ids)}, {len(classes)}), got {logits.shape}")
    if not np.isfinite(logits).all():
        raise ValueError("teacher logits contain NaN or inf")
    if len(set(ids)) != len(ids):
        raise ValueError("teacher output ids are not unique")
    with atomic_open(path, "wb") as handle:
        np.savez(handle, ids=np.asarray(list(ids), dtype=str), logits=logits,
                 classes=np.asarray(list(classes), dtype=str),
                 meta=np.asarray(json.dumps(meta or {})))  # fmt: skip


def read_teacher_outputs(path: str | os.PathLike, *, temperature: float) -> TeacherOutputs:
    """Read the store and apply the temperature: ``probs = softmax(logits / tau)``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"teacher outputs {path} not found: run train_teacher.py with "
                                "the same output_folder first")  # fmt: skip
    with np.load(path, allow_pickle=False) as data:
        missing = {"ids", "logits", "classes", "meta"} - set(data.files)
        if missing:
            raise ValueError(f"{path}: not a teacher-output file (missing {sorted(missing)})")
        ids, logits = [str(i) for i in data["ids"]], data["logits"].astype(np.float64)
        classes, meta = [str(c) for c in data["classes"]], json.loads(str(data["meta"]))
    z = logits / temperature
    z -= z.max(axis=1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=1, keepdims=True)
    return TeacherOutputs(ids, logits, probs, classes, float(temperature), meta)

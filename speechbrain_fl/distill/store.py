"""The teacher-output store: one file holding the teacher's logits on D_aux.

The teacher is queried once; its raw logits (not probabilities) are written here with the
record ids and class names, and this file is all the student ever sees of the teacher. The
temperature is applied when reading (``softmax(z / tau)``), so tau can change without a new
query. The file is an uncompressed NumPy ``.npz`` (``ids``, ``logits``, ``classes``, ``meta``
as a JSON string) written atomically.

**The teacher's outputs are one unit.** The logits file and the teacher run's
``results.json`` are two files, each written atomically, so a run killed between the two writes
(or a file copied from another run) could pair one run's logits with another run's privacy
figures: a student would then claim, say, epsilon 0.995 for a non-private teacher's logits. The
teacher therefore writes the logits first, with its privacy settings and a random ``run_id`` in
``meta``, and then ``results.json``, last, holding :func:`teacher_outputs_record` of the file
(its SHA-256, the run id and the same privacy settings): ``results.json`` is the manifest,
and it exists only once the logits it describes are complete. :func:`verify_teacher_outputs`
(the student, before it reads a single logit) recomputes the file's SHA-256 and compares the
privacy settings and run id in the file with those of the results; any difference, or a
results file without the record, raises :class:`TeacherOutputMismatchError` naming the key.

Example
-------
>>> import numpy as np
>>> path = getfixture("tmp_path") / "aux_logits.npz"
>>> write_teacher_outputs(path, ids=["a", "b"], logits=np.array([[2.0, 0.0], [0.0, 0.0]]),
...                       classes=["male", "female"], meta={"epsilon": 1.0})
>>> out = read_teacher_outputs(path, temperature=2.0)
>>> out.ids, out.probs.round(3).tolist(), out.meta["epsilon"]
(['a', 'b'], [[0.731, 0.269], [0.5, 0.5]], 1.0)
>>> results = {"privacy": {"epsilon": 1.0}, "teacher_outputs": teacher_outputs_record(path)}
>>> verify_teacher_outputs(path, out, teacher_results=results, results_path="results.json")
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from speechbrain_fl.utils.atomic import atomic_open

__all__ = [
    "PRIVACY_KEYS",
    "TeacherOutputMismatchError",
    "TeacherOutputs",
    "file_sha256",
    "read_teacher_outputs",
    "teacher_outputs_record",
    "verify_teacher_outputs",
    "write_teacher_outputs",
]

#: Privacy settings recorded in the logits file's ``meta`` and in the teacher's results
#: (``results["privacy"]``); :func:`verify_teacher_outputs` requires them to agree.
PRIVACY_KEYS = (
    "epsilon",
    "delta",
    "accountant",
    "noise_multiplier",
    "sampling_rate",
    "clip",
    "steps",
    "aw_batch_adaptive",
)


class TeacherOutputMismatchError(ValueError):
    """The teacher-output file is not the one the teacher results describe."""


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
        np.savez(
            handle,
            ids=np.asarray(list(ids), dtype=str),
            logits=logits,
            classes=np.asarray(list(classes), dtype=str),
            meta=np.asarray(json.dumps(meta or {})),
        )


def read_teacher_outputs(path: str | os.PathLike, *, temperature: float) -> TeacherOutputs:
    """Read the store and apply the temperature: ``probs = softmax(logits / tau)``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"teacher outputs {path} not found: run train_teacher.py with "
            "the same output_folder first"
        )
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


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def teacher_outputs_record(path: str | os.PathLike) -> dict:
    """What the teacher's results record of its logits file: name, SHA-256, run id, privacy.

    Read from the file just written (so the record describes the bytes on disk); the teacher
    puts it in ``results.json``, which it writes last.
    """
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
    return {
        "file": os.path.basename(path),
        "sha256": file_sha256(path),
        "run_id": meta.get("run_id"),
        "privacy": {k: meta[k] for k in PRIVACY_KEYS if k in meta},
    }


def verify_teacher_outputs(
    path: str | os.PathLike,
    outputs: TeacherOutputs,
    *,
    teacher_results: dict,
    results_path: str | os.PathLike,
) -> None:
    """Refuse logits that are not the ones the teacher results describe (module docstring).

    Arguments
    ---------
    path : str or os.PathLike
        The logits file ``outputs`` was read from.
    outputs : TeacherOutputs
        As read by :func:`read_teacher_outputs`.
    teacher_results : dict
        The teacher run's ``results.json`` (its ``privacy`` block and its
        ``teacher_outputs`` record).
    results_path : str or os.PathLike
        Where ``teacher_results`` was read (for the messages).

    Raises
    ------
    TeacherOutputMismatchError
        No record, another SHA-256 or run id, or privacy settings that differ, naming the key
        and both values.
    """
    record = teacher_results.get("teacher_outputs")
    if not isinstance(record, dict) or "sha256" not in record:
        raise TeacherOutputMismatchError(
            f"{results_path} records no fingerprint of the teacher outputs (written by an older "
            f"or interrupted teacher run): cannot tell whether {path} is its logits; rerun "
            "train_teacher.py"
        )
    digest = file_sha256(path)
    if digest != record["sha256"]:
        raise TeacherOutputMismatchError(
            f"{path} has SHA-256 {digest[:16]}..., but {results_path} describes a file with "
            f"{record['sha256'][:16]}...: the logits come from another teacher run (or the run "
            "was interrupted between its two writes); rerun train_teacher.py"
        )
    if outputs.meta.get("run_id") != record.get("run_id"):
        raise TeacherOutputMismatchError(
            f"{path} is from teacher run {outputs.meta.get('run_id')!r}, {results_path} from "
            f"{record.get('run_id')!r}"
        )
    privacy = teacher_results.get("privacy") or {}
    for key in PRIVACY_KEYS:
        in_file, in_record = outputs.meta.get(key), record["privacy"].get(key)
        in_results = privacy.get(key)
        if not in_file == in_record == in_results:
            raise TeacherOutputMismatchError(
                f"privacy setting {key!r} differs: {in_file!r} in {path}, {in_record!r} in the "
                f"record and {in_results!r} in the privacy block of {results_path}"
            )

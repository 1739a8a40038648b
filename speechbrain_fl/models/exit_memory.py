"""Peak training memory of a multi-exit wav2vec 2.0 per exit, and depth choice under a budget.

:func:`peak_training_memory` measures one optimiser step (forward to the exit, loss, backward,
AdamW step) for a batch shape:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (weights,
  activations, gradients, optimiser state), in this process;
- CPU: the peak resident set size (``ru_maxrss``) of a *fresh* Python subprocess that loads the
  model and runs the step, so one depth's allocations cannot hide another's. ``step_mb`` is how
  much the step raised that peak (the high-water mark after the step minus the one before it:
  activations, gradients and optimiser state beyond what loading already touched; 0 when the
  step stays below the loading peak, so it is a lower bound of what the step allocates).

``model_mb`` is the figure a user compares across depths: the high-water mark of the RSS from
the moment everything is imported (reset with Linux's ``clear_refs``) minus the RSS then
(``import_mb``: the interpreter, torch, transformers, ~700 MB on CPU), i.e. weights +
activations + gradients + optimiser state. On CUDA it equals ``peak_mb``
(imports allocate no device memory). LayerDrop is off in the measured step (``layerdrop: 0``;
the config's default 0.1 would skip layers at random and understate a depth's peak).
:func:`manifest_seconds` gives the input length to measure with from a task's manifests
(e.g. the 95th percentile of the training clips' durations) instead of a fixed length.

:func:`choose_depth` (ours; the paper decides L_max from "local hardware resources" without a
rule) picks the deepest exit not above the task cap whose measured peak fits a memory budget;
measurements are cached per model, shape and options in a JSON file, so a client measures once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["choose_depth", "manifest_seconds", "peak_training_memory"]

logger = logging.getLogger(__name__)


def _step(options: dict) -> dict:
    """Build the model and run one training step; return memory figures (runs in the worker)."""
    import resource

    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit

    device = options["device"]
    cuda = device.startswith("cuda")
    # model-only figure: the RSS once everything is imported, and the high-water mark reset
    # to it (Linux clear_refs 5), so the later high-water mark is this model's and step's own
    imported = _reset_high_water_mark()
    model = build_multi_exit(
        options["source"],
        num_outputs=options["num_outputs"],
        cache_dir=options.get("cache_dir") or ".",
        head=options["head"],
        freeze_feature_encoder=options["freeze_feature_encoder"],
        config_overrides={"layerdrop": 0.0, **dict(options.get("config_overrides") or {})},
    ).to(device)
    model.train()
    samples = int(options["seconds"] * 16000)
    wavs = torch.randn(options["batch_size"], samples, device=device)
    lens = torch.ones(options["batch_size"], device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = model(wavs, lens, depth=options["depth"])
    loss = out.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
        return {"peak_mb": peak / 2**20, "step_mb": (peak - before) / 2**20,
                "model_mb": peak / 2**20, "import_mb": 0.0, "kind": "cuda"}  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    high = _proc_status_kib("VmHWM") if imported is not None else None
    model = (high - imported) if high is not None else float("nan")
    return {"peak_mb": peak / 1024, "step_mb": (peak - before) / 1024,
            "model_mb": model / 1024, "import_mb": (imported or float("nan")) / 1024,
            "kind": "cpu_rss"}  # fmt: skip


def _proc_status_kib(field: str) -> float | None:
    """A ``/proc/self/status`` memory field (KiB), or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _reset_high_water_mark() -> float | None:
    """Reset this process's peak RSS (VmHWM) to its current RSS; return that RSS (KiB).

    Linux ``/proc/self/clear_refs`` with ``5`` (since 4.0). None where that is unavailable
    (the model-only figure is then NaN).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return None
    return _proc_status_kib("VmRSS")


def manifest_seconds(manifests, *, quantile=0.95, column="duration"):
    """The ``quantile`` of the clip durations (s) over one or more CSV manifests.

    The input length a memory measurement should use for a task: its clips' p95 rather than a
    fixed length (real Speech Commands clips are <= 1 s; LibriSpeech train-clean-100 averages
    ~12.7 s). Raises naming the file when a manifest has no ``column``.

    Example
    -------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.csv")
    >>> _ = open(path, "w").write("ID,duration\\n" + "".join(f"u{i},{i}\\n" for i in range(1, 21)))
    >>> manifest_seconds([path])
    19.05
    """
    import csv

    import numpy as np

    durations = []
    for path in [manifests] if isinstance(manifests, (str, os.PathLike)) else manifests:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if column not in (reader.fieldnames or []):
                raise ValueError(f"{path}: no {column!r} column to take clip lengths from")
            durations += [float(row[column]) for row in reader]
    if not durations:
        raise ValueError(f"manifests {manifests} hold no clips")
    return round(float(np.quantile(durations, quantile)), 4)


def peak_training_memory(
    source: str,
    *,
    depth: int,
    batch_size: int,
    seconds: float,
    head: str = "utterance",
    num_outputs: int = 12,
    freeze_feature_encoder: bool = False,
    device: str = "cpu",
    cache_dir: str | None = None,
    timeout: float = 600.0,
    config_overrides: dict | None = None,
) -> dict:
    """Peak memory (MiB) of one training step at exit ``depth`` (see the module docstring).

    ``config_overrides`` are ``Wav2Vec2Config`` fields for the step (``layerdrop`` is 0
    unless given).

    Returns
    -------
    dict
        ``{"peak_mb", "step_mb", "model_mb", "import_mb", "kind"}`` (``kind`` is ``cuda`` or
        ``cpu_rss``).

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone
    >>> src = resolve_backbone("tiny", cache_dir=tempfile.mkdtemp())
    >>> m = peak_training_memory(src, depth=3, batch_size=2, seconds=0.5)
    >>> m["kind"], m["peak_mb"] > m["step_mb"] >= 0, m["peak_mb"] > m["model_mb"] > 0
    ('cpu_rss', True, True)
    """
    options = {
        "source": str(source),
        "depth": int(depth),
        "batch_size": int(batch_size),
        "seconds": float(seconds),
        "head": head,
        "num_outputs": int(num_outputs),
        "freeze_feature_encoder": bool(freeze_feature_encoder),
        "device": device,
        "cache_dir": cache_dir,
        "config_overrides": dict(config_overrides or {}),
    }
    if device.startswith("cuda"):
        return _step(options)
    code = (
        "import json, sys; from speechbrain_fl.models.exit_memory import _step; "
        "print('RESULT ' + json.dumps(_step(json.loads(sys.argv[1]))))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(options)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement failed for {options}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def choose_depth(
    *,
    budget_mb: float,
    exits: list[int],
    cap: int,
    measure,
    cache_file: str | os.PathLike | None = None,
    cache_key: str = "",
) -> int | None:
    """Deepest exit <= ``cap`` whose measured peak memory fits ``budget_mb`` (ours).

    Arguments
    ---------
    budget_mb : float
        The client's memory budget.
    exits : list of int
        The model's exits.
    cap : int
        The task's deepest useful exit (the paper's task-awareness bound).
    measure : callable
        ``measure(depth) -> peak MiB`` (e.g. a partial of :func:`peak_training_memory`).
    cache_file : path, optional
        JSON file of earlier measurements ``{cache_key: {depth: mb}}``.
    cache_key : str
        Identifies the model, batch shape and options of the measurements.

    Returns
    -------
    int or None
        The exit, or ``None`` when even the shallowest does not fit.

    Example
    -------
    >>> fake = {3: 100.0, 6: 150.0, 9: 200.0, 12: 250.0}.__getitem__
    >>> choose_depth(budget_mb=210, exits=[3, 6, 9, 12], cap=12, measure=fake)
    9
    >>> choose_depth(budget_mb=210, exits=[3, 6, 9, 12], cap=6, measure=fake)
    6
    >>> choose_depth(budget_mb=50, exits=[3, 6, 9, 12], cap=12, measure=fake) is None
    True
    """
    cache: dict = {}
    if cache_file is not None and os.path.isfile(cache_file):
        with open(cache_file, encoding="utf-8") as handle:
            cache = json.load(handle)
    known = cache.setdefault(cache_key, {})
    chosen = None
    for depth in sorted(e for e in exits if e <= cap):
        if str(depth) not in known:
            known[str(depth)] = float(measure(depth))
        if known[str(depth)] <= budget_mb:
            chosen = depth
        else:
            break  # memory grows with depth
    if cache_file is not None:
        from speechbrain_fl.utils.atomic import atomic_open

        with atomic_open(cache_file) as handle:
            json.dump(cache, handle, indent=2)
    return chosen

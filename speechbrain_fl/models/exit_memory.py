"""Training memory of a multi-exit wav2vec 2.0 per exit, and depth choice under a budget.

:func:`training_memory` is the figure a user reads per exit: the training peak of a client,
split into what it is made of, for one optimiser step (forward to the exit, loss, backward,
AdamW step) at a batch shape:

- ``weights``: the parameters the forward to the exit uses (the layers past the exit and the
  other exits' heads are not needed by a client stopping there), ``4 N_used`` bytes in fp32;
- ``gradients``: one fp32 gradient per parameter that trains (frozen parts, e.g. a frozen CNN
  feature encoder, have none), ``4 N_train``;
- ``optimizer``: AdamW's two fp32 moments per trained parameter, ``8 N_train`` (the step
  counters, one scalar per tensor, are left out);
- ``activations``: the tensors autograd saves for backward during the forward to the exit
  (counted with ``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's storage
  once, parameters excluded), their peak, reached when the forward ends;
- ``total`` = the sum of the four. On CPU it is counted from the tensors, so it is
  deterministic and independent of the process (method ``tensors``; an upper bound of the
  step's high-water mark, since gradients grow while activations are freed in backward, and
  a lower bound of what an allocator holds, which also keeps short-lived temporaries). On CUDA
  ``total`` is ``torch.cuda.max_memory_allocated`` over the step with the whole model on the
  device (method ``cuda_max_memory_allocated``); the four parts are counted as on CPU.

:func:`peak_training_memory` measures the process instead (it is what a memory budget of
the ``memory_budget`` depth policy is compared against), for the same step:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (weights,
  activations, gradients, optimiser state), in this process;
- CPU: the peak resident set size (``ru_maxrss``) of a *fresh* Python subprocess that loads the
  model and runs the step, so one depth's allocations cannot hide another's. ``step_mb`` is how
  much the step raised that peak (the high-water mark after the step minus the one before it:
  activations, gradients and optimiser state beyond what loading already touched; 0 when the
  step stays below the loading peak, so it is a lower bound of what the step allocates).

``model_mb`` is the high-water mark of the RSS from
the moment everything is imported (reset with Linux's ``clear_refs``) minus the RSS then
(``import_mb``: the interpreter, torch, transformers, ~700 MB on CPU), i.e. weights +
activations + gradients + optimiser state. On CUDA it equals ``peak_mb``
(imports allocate no device memory). On CPU these figures are dominated by the process
(allocator caching, imports): they move little between exits. LayerDrop is off in the measured
steps (``layerdrop: 0``;
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

__all__ = [
    "choose_depth",
    "count_step_memory",
    "manifest_seconds",
    "peak_training_memory",
    "training_memory",
]

logger = logging.getLogger(__name__)


def _step(options: dict) -> dict:
    """Build the model and run one training step; return memory figures (runs in the worker)."""
    import resource

    # imported before the high-water mark is reset: the model-only figure leaves imports out
    import speechbrain_fl.models.multi_exit_wav2vec2  # noqa: F401

    device = options["device"]
    cuda = device.startswith("cuda")
    # model-only figure: the RSS once everything is imported, and the high-water mark reset
    # to it (Linux clear_refs 5), so the later high-water mark is this model's and step's own
    imported = _reset_high_water_mark()
    model, wavs, lens = _model_and_batch(options)
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


def _model_and_batch(options: dict):
    """The multi-exit model in train mode and a batch of ``batch_size`` clips of ``seconds``."""
    from speechbrain_fl.models.multi_exit_wav2vec2 import build_multi_exit

    device = options["device"]
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
    return model, wavs, lens


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def count_step_memory(model: torch.nn.Module, forward, *, optimizer=None) -> dict:
    """Bytes of one training step of ``model``, counted from its tensors.

    Runs ``out = forward()``, the loss ``mean(out^2)``, backward and ``optimizer.step()``
    (a fresh ``AdamW`` over the parameters with ``requires_grad`` when None), and counts:

    - ``weights = sum 4 |p|`` over the parameters of the modules the forward called (module
      pre-hooks; a parameter shared by several modules once);
    - ``gradients = sum |p.grad|`` bytes over the parameters backward gave a gradient;
    - ``optimizer`` = the optimiser's state tensors shaped like their parameter (AdamW's
      ``exp_avg`` and ``exp_avg_sq``: ``8 |p|`` per trained fp32 parameter);
    - ``activations`` = the tensors autograd saved during the forward and the loss, each
      storage once (keyed by its address) and parameters' storages excluded;
    - ``total`` = the sum of the four.

    Returns
    -------
    dict
        ``{"total", "weights", "gradients", "optimizer", "activations"}`` in bytes.

    Example
    -------
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> net[0].requires_grad_(False)  # doctest: +ELLIPSIS
    Linear(...)
    >>> m = count_step_memory(net, lambda: net(torch.ones(5, 4)))
    >>> m["weights"], m["gradients"], m["optimizer"]  # 23 weights, 8 of them train
    (92, 32, 64)
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    called: dict[int, torch.nn.Module] = {}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    def note_call(module, _args):  # returns None: the inputs go through unchanged
        called[id(module)] = module

    handles = [m.register_forward_pre_hook(note_call) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = forward().float().pow(2).mean()
    finally:
        for handle in handles:
            handle.remove()
    activations = sum(saved.values())
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    loss.backward()
    optimizer.step()
    used = {id(p): p for mod in called.values() for p in mod.parameters(recurse=False)}
    gradients = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    moments = sum(
        _nbytes(value)
        for p, state in optimizer.state.items()
        for value in state.values()
        if torch.is_tensor(value) and value.shape == p.shape
    )
    out = {
        "weights": sum(_nbytes(p) for p in used.values()),
        "gradients": gradients,
        "optimizer": moments,
        "activations": activations,
    }
    return {"total": sum(out.values()), **out}


def training_memory(
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
    config_overrides: dict | None = None,
) -> dict:
    """Training memory (MiB) of a client at exit ``depth``, by part (see the module docstring).

    One step of the multi-exit model built from ``source`` on ``batch_size`` clips of
    ``seconds`` (random audio: the sizes do not depend on the values), in this process.
    ``config_overrides`` are ``Wav2Vec2Config`` fields (``layerdrop`` is 0 unless given).

    Returns
    -------
    dict
        ``{"total", "weights", "gradients", "optimizer", "activations"}`` in MiB and
        ``"method"``: ``tensors`` (CPU: total = the sum of the parts) or
        ``cuda_max_memory_allocated`` (total = the device's peak over the step).

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone
    >>> src = resolve_backbone("tiny", cache_dir=tempfile.mkdtemp())
    >>> m3, m12 = (training_memory(src, depth=d, batch_size=2, seconds=0.5) for d in (3, 12))
    >>> m3["method"], 0 < m3["total"] < m12["total"]
    ('tensors', True)
    """
    options = {
        "source": str(source),
        "batch_size": int(batch_size),
        "seconds": float(seconds),
        "head": head,
        "num_outputs": int(num_outputs),
        "freeze_feature_encoder": bool(freeze_feature_encoder),
        "device": device,
        "cache_dir": cache_dir,
        "config_overrides": dict(config_overrides or {}),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # SpecAugment's masks: the same batch for every exit
        model, wavs, lens = _model_and_batch(options)
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        counted = count_step_memory(model, lambda: model(wavs, lens, depth=int(depth)))
    out = {key: value / 2**20 for key, value in counted.items()}
    out["method"] = "tensors"
    if cuda:
        torch.cuda.synchronize()
        out["total"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["method"] = "cuda_max_memory_allocated"
    return out


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

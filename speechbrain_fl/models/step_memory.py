"""Two CPU measures of one training step of a multi-exit wav2vec 2.0 at an exit.

:func:`step_memory` gives, for the same step, the tensors of the step
(:func:`speechbrain_fl.models.exit_memory.count_step_memory`) and the peak of live tensor
storages over it (PyTorch's ``MemTracker``), with and without the weights of the layers past
the exit; ``recipes/SUPERB/studies/memory_by_exit.py --per_task`` compares exit 3 with exit 12
per task with it.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import torch

from speechbrain_fl.models.exit_memory import _model_and_batch, _nbytes, count_step_memory

__all__ = ["step_memory"]


def _tracker():
    """A ``MemTracker`` that leaves frozen parameters without gradient hooks.

    ``MemTracker`` hooks every parameter of a module it enters to label gradients, which a
    parameter without ``requires_grad`` (a frozen CNN front-end) refuses; such a module is
    entered without those hooks (every storage is still counted, the label aside).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            trains = all(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(
                module, install_grad_hooks=install_grad_hooks and trains
            )

    return _Tracker()


def step_memory(
    source: str,
    *,
    depth: int,
    batch_size: int,
    seconds: float,
    head: str = "utterance",
    num_outputs: int = 12,
    freeze_feature_encoder: bool = False,
    cache_dir: str | None = None,
    config_overrides: dict | None = None,
) -> dict:
    """Two CPU measures (MiB) of one training step at exit ``depth``: saved tensors and peak.

    A training step of the model built from ``source`` (as :func:`training_memory`, on CPU)
    after a first one has created the AdamW moments (a step on zero gradients, here), which a
    training loop holds through every later step (``zero_grad`` frees the gradients between
    steps), runs
    inside PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), a dispatch mode
    that registers the storage of every tensor an operator creates and drops it when freed. Its
    peak is the largest sum of live storages over the step, the figure a GPU's
    ``max_memory_allocated`` reports less the allocator's rounding: weights, gradients, the
    AdamW moments, the activations kept for backward and the short-lived buffers an operator
    returns (e.g. a frozen CNN's outputs before the Transformer).

    - ``saved``: :func:`count_step_memory` of the same step (weights used, gradients, moments,
      saved activations; their sum ``total``);
    - ``peak``: ``{"total", "weights", "gradients", "optimizer", "activations", "temporaries"}``
      at the moment of the peak; ``weights`` counts only the parameters the forward to the exit
      uses (the unused layers' and heads' bytes are subtracted, as a client stopping at the
      exit does not hold them), and the input batch is counted in ``activations``;
    - ``resident``: the same peak for a client that loads every layer and head of the model
      and runs the forward only to the exit (``total`` = peak + ``unused_weights``).

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.models.multi_exit_wav2vec2 import resolve_backbone
    >>> src = resolve_backbone("tiny", cache_dir=tempfile.mkdtemp())
    >>> m3 = step_memory(src, depth=3, batch_size=2, seconds=0.5)
    >>> m12 = step_memory(src, depth=12, batch_size=2, seconds=0.5)
    >>> 0 < m3["peak"]["total"] < m12["peak"]["total"], m3["saved"]["total"] < m12["saved"]["total"]
    (True, True)
    """
    options = {
        "source": str(source),
        "batch_size": int(batch_size),
        "seconds": float(seconds),
        "head": head,
        "num_outputs": int(num_outputs),
        "freeze_feature_encoder": bool(freeze_feature_encoder),
        "device": "cpu",
        "cache_dir": cache_dir,
        "config_overrides": dict(config_overrides or {}),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # SpecAugment's masks: the same batch for every exit
        model, wavs, lens = _model_and_batch(options)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        trained = set(model.trained_parameter_names(int(depth)))
        for name, param in model.named_parameters():  # AdamW's moments, as after a first step
            param.grad = torch.zeros_like(param) if name in trained else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the measured step: moments held, no gradients
        tracker = _tracker()
        tracker.track_external(model, optimizer, wavs, lens)
        with tracker:
            counted = count_step_memory(
                model, lambda: model(wavs, lens, depth=int(depth)), optimizer=optimizer
            )
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    unused = sum(_nbytes(p) for p in model.parameters()) - counted["weights"]
    by_kind = {kind.value: value for kind, value in snapshot.items() if hasattr(kind, "value")}
    peak = {
        "total": snapshot["Total"] - unused,
        "weights": by_kind.get("Parameter", 0) + by_kind.get("Buffer", 0) - unused,
        "gradients": by_kind.get("Gradient", 0),
        "optimizer": by_kind.get("Optstate", 0),
        "activations": by_kind.get("Activation", 0) + by_kind.get("Other", 0),
        "temporaries": by_kind.get("Temp", 0),
    }
    mib = 2**20
    return {
        "saved": {key: value / mib for key, value in counted.items()},
        "peak": {key: value / mib for key, value in peak.items()},
        "resident": {"total": (peak["total"] + unused) / mib, "unused_weights": unused / mib},
    }

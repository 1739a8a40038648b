"""SpeechBrain's run options in a federated recipe: the ones honoured, the ones refused.

SpeechBrain's run options (``sb.parse_arguments``: ``--device``, ``--precision``,
``--max_grad_norm``, ...) either work in a federated recipe or are refused:
:func:`federated_run_options` keeps those the user set that the federated loop and the seed
pretraining honour (:data:`SUPPORTED_RUN_OPTIONS`) and raises, naming the option and why, for
the others (:data:`REFUSED_RUN_OPTIONS`). :func:`split_overrides` separates run options from
hparams overrides when both arrive in one mapping (a ``flwr run --run-config``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from speechbrain.utils.run_opts import RunOptions

__all__ = [
    "REFUSED_RUN_OPTIONS",
    "SUPPORTED_RUN_OPTIONS",
    "federated_run_options",
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

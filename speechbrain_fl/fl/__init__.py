"""Federated engine of speechbrain-fl on Flower's Message API.

A recipe provides an :class:`FLTask` (a ClientApp builder returning a :class:`ClientTask` with a
SpeechBrain ``Brain`` and the client's data, and a ServerApp builder returning a
:class:`ServerTask` with the starting model and an :class:`FLConfig`), from one factory that
both engines load (:mod:`speechbrain_fl.fl.task`). :func:`run_simulation` runs it on one machine,
in process through :class:`~speechbrain_fl.fl.local_grid.LocalGrid` (``backend: local``) or on
Flower's Simulation Engine with Ray (``backend: ray``); ``flwr run`` runs the same task through :mod:`speechbrain_fl.fl.apps`
on a simulation federation or the Deployment Engine. The server strategy :class:`DPFedAvg` does
Poisson sampling, server-side re-clipping, a pluggable aggregation rule, central Gaussian noise
and RDP accounting; every round is checkpointed so the same command resumes. See
docs/fl_engine.md.

The names below are imported on first use (PEP 562), so ``speechbrain_fl.fl.params`` or
``speechbrain_fl.fl.config`` can be imported without loading Flower and Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClientTask": "client",
    "ClientUpdate": "aggregation",
    "DPFedAvg": "strategy",
    "FLConfig": "config",
    "FLTask": "task",
    "FlwrRunError": "engine",
    "PoissonSampler": "sampling",
    "RoundFailed": "strategy",
    "RoundReport": "strategy",
    "ServerResult": "server",
    "ServerTask": "server",
    "TaskSpec": "task",
    "get_rule": "aggregation",
    "load_task": "task",
    "load_trainable": "params",
    "make_client_app": "client",
    "make_server_app": "server",
    "params_fingerprint": "params",
    "resolved_settings": "task",
    "run_deployment": "engine",
    "run_server": "server",
    "run_simulation": "engine",
    "train_round": "client",
    "trainable_parameters": "params",
    "trainable_state": "params",
    "uniform_mean": "aggregation",
    "weighted_mean": "aggregation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

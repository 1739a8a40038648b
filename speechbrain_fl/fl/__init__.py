"""Federated engine of speechbrain-fl on Flower's Message API.

Rooms: ``clientapp/`` (the ClientApp's train handler and a client round), ``serverapp/`` (the
ServerApp's main, the round loop, the DP strategy, the checks of every reply), ``dp/`` (cohort
sampling, the mechanism, the audit, what the guarantee covers), ``settings/`` (:class:`FLConfig`
and every check of it), ``aggregate/`` (aggregation rules), ``secagg/`` (Flower's SecAgg+),
``engines/`` (the local backend, Ray, ``flwr run``, deployment); beside them the recipe-facing
:mod:`.task`, the model's federated :mod:`.params`, a node's own data (:mod:`.node_data`), the
wire format (:mod:`.npy_codec`) and the :mod:`.toy` task. See docs/fl_engine.md.

The names below are imported on first use (PEP 562), so ``speechbrain_fl.fl.params`` or
``speechbrain_fl.fl.settings.config`` can be imported without loading Flower and Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClientTask": "clientapp.train",
    "ClientUpdate": "aggregate.update",
    "DPFedAvg": "serverapp.strategy",
    "FLConfig": "settings.config",
    "FLTask": "task",
    "FlwrRunError": "engines.run",
    "PoissonSampler": "dp.sampling",
    "RoundFailed": "aggregate.round_report",
    "RoundReport": "aggregate.round_report",
    "ServerResult": "serverapp.task",
    "ServerTask": "serverapp.task",
    "TaskSpec": "task",
    "get_rule": "aggregate.rules",
    "load_task": "task",
    "load_trainable": "params",
    "make_client_app": "clientapp.train",
    "make_server_app": "serverapp.main",
    "params_fingerprint": "params",
    "resolved_settings": "task",
    "run_deployment": "engines.run",
    "run_server": "serverapp.main",
    "run_simulation": "engines.run",
    "train_round": "clientapp.train",
    "trainable_parameters": "params",
    "trainable_state": "params",
    "uniform_mean": "aggregate.rules",
    "weighted_mean": "aggregate.rules",
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

"""Federated engine of speechbrain-fl on Flower's Message API.

A recipe provides an :class:`FLTask` (a ClientApp builder returning a :class:`ClientTask` with a
SpeechBrain ``Brain`` and the client's data, and a ServerApp builder returning a
:class:`ServerTask` with the starting model and an :class:`FLConfig`). :func:`run_simulation`
runs it on the Simulation Engine (Ray); ``flwr run .`` runs the same task on the Deployment
Engine through :mod:`speechbrain_fl.fl.apps`. The server strategy :class:`DPFedAvg` does Poisson
sampling, server-side re-clipping, a pluggable aggregation rule, central Gaussian noise and RDP
accounting; every round is checkpointed so the same command resumes. See docs/fl_engine.md.
"""

from . import layerwise  # noqa: E402,F401  (registers the layer-wise rules)
from .aggregation import ClientUpdate, get_rule, uniform_mean, weighted_mean
from .client import ClientTask, make_client_app, train_round, trainable_parameters
from .config import FLConfig
from .engine import run_deployment, run_simulation
from .sampling import PoissonSampler
from .server import ServerResult, ServerTask, make_server_app, run_server
from .strategy import DPFedAvg, RoundFailed, RoundReport
from .task import FLTask

__all__ = [
    "ClientTask",
    "ClientUpdate",
    "DPFedAvg",
    "FLConfig",
    "FLTask",
    "PoissonSampler",
    "RoundFailed",
    "RoundReport",
    "ServerResult",
    "ServerTask",
    "get_rule",
    "make_client_app",
    "make_server_app",
    "run_deployment",
    "run_server",
    "run_simulation",
    "train_round",
    "trainable_parameters",
    "uniform_mean",
    "weighted_mean",
]

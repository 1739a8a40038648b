"""The recipe-facing bundle an engine runs: one ServerApp and one ClientApp builder.

A recipe exposes a factory ``factory(hparams_path, overrides) -> FLTask`` (see
:func:`speechbrain_fl.fl.toy.toy_task`). The simulation engine calls it in-process; the
deployment apps (:mod:`speechbrain_fl.fl.apps`) call it in the ServerApp and in every ClientApp
from the run config, so the same recipe runs on both engines. The builders must be picklable
(module-level functions or ``functools.partial`` of them): Ray ships the ClientApp to its actors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import Context

from .client import ClientTask
from .server import ServerTask

__all__ = ["FLTask"]


@dataclass
class FLTask:
    """Builders of the two sides of a federated recipe.

    Arguments
    ---------
    build_client : callable
        ``build_client(context) -> ClientTask``.
    build_server : callable
        ``build_server(context) -> ServerTask``.
    num_partitions : int
        Number of clients K the data is partitioned into (SuperNodes in simulation).
    """

    build_client: Callable[[Context], ClientTask]
    build_server: Callable[[Context], ServerTask]
    num_partitions: int

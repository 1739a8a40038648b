"""A toy SpeechBrain task for tests, the README example and the overhead benchmark.

Linear regression y = x w* + b* + noise on generated tensors, one partition of examples per
client (client ``i`` draws its inputs with seed ``seed + 1 + i``), trained by a real
``speechbrain.Brain`` with SGD. :func:`toy_task` returns the :class:`FLTask` the engines run;
its settings are the toy keys below plus the federated/privacy YAML keys that
:meth:`~speechbrain_fl.fl.settings.config.FLConfig.from_hparams` reads (``number_of_rounds``, ``method``,
``noise_multiplier``, ``clip``, ...), from an optional HyperPyYAML file and then from
``overrides`` (hyphens in keys, as Flower's run_config writes them, are read as underscores).

A data-owning SuperNode (``--node-config "data-folder=..."`` or ``"data-manifest=..."``,
:mod:`speechbrain_fl.fl.node_data`) trains on its own manifest instead of the generated
partition: a CSV with columns ``ID, x0, ..., x<F-1>, y`` (:func:`write_toy_manifest` writes a
partition in that format, the way a data owner would export its examples), on its ``device``.
"""

from __future__ import annotations

import csv
import functools
import os
from typing import Any

import speechbrain as sb
import torch
from flwr.app import Context
from hyperpyyaml import load_hyperpyyaml
from speechbrain.dataio.batch import PaddedBatch

from speechbrain_fl.fl.clientapp.collation import TensorRows
from speechbrain_fl.fl.clientapp.train import ClientTask
from speechbrain_fl.fl.node_data import NodeData
from speechbrain_fl.fl.serverapp.task import ServerTask
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.task import FLTask

__all__ = [
    "ToyBrain",
    "read_toy_manifest",
    "toy_client",
    "toy_server",
    "toy_settings",
    "toy_task",
    "write_toy_manifest",
]

TOY_DEFAULTS: dict[str, Any] = {
    "num_partitions": 4,
    "num_features": 4,
    "examples_per_client": 32,
    "valid_examples": 64,
    "batch_size": 8,
    "lr": 0.1,
    "data_seed": 0,
    "output_folder": "results/toy_fl",
    "method": "fedavg",
}
FL_KEYS = FLConfig.yaml_keys()


class ToyBrain(sb.Brain):
    """Linear regression Brain (MSE loss)."""

    def compute_forward(self, batch, stage):
        """Predict y from x (the inputs moved to the Brain's device)."""
        return self.modules.model(batch.x.data.to(self.device))

    def compute_objectives(self, predictions, batch, stage):
        """Mean squared error (the targets moved to the Brain's device)."""
        return torch.nn.functional.mse_loss(predictions, batch.y.data.to(self.device))


class _Examples(torch.utils.data.Dataset):
    """Examples ``{"x": x[i], "y": y[i]}`` of two tensors.

    The rows are the views ``x.unbind(0)``, made when ``x`` (or ``y``) is set (``x[i]`` is the
    same view: the same storage, offset and strides), so an example is two tuple look-ups
    instead of two tensor indexing calls; ``__getitems__`` is torch's batched protocol
    (``DataLoader`` fetches a batch's examples in one call), the same examples in the same order,
    as a :class:`~speechbrain_fl.fl.clientapp.collation.TensorRows` list when ``x`` and ``y`` are plain
    tensors of ``ndim >= 2`` without gradient (their rows are then equal-shape tensors, so the
    collation skips its per-value check), a plain list otherwise.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"toy examples: {len(x)} inputs but {len(y)} targets")
        self.x, self.y = x, y

    @property
    def x(self) -> torch.Tensor:
        """The inputs, one row per example."""
        return self._x

    @x.setter
    def x(self, value: torch.Tensor) -> None:
        self._x, self._xs = value, value.unbind(0)
        self._rows = _row_batches(value, getattr(self, "_y", None))

    @property
    def y(self) -> torch.Tensor:
        """The targets, one row per example."""
        return self._y

    @y.setter
    def y(self, value: torch.Tensor) -> None:
        self._y, self._ys = value, value.unbind(0)
        self._rows = _row_batches(self._x, value)

    def __len__(self) -> int:
        return len(self._xs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self._xs[i], "y": self._ys[i]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        xs, ys = self._xs, self._ys
        batch = [{"x": xs[i], "y": ys[i]} for i in indices]
        return batch if self._rows is list else TensorRows(batch)


def _row_batches(x: torch.Tensor, y: torch.Tensor | None) -> type:
    """``TensorRows`` where the rows of ``x`` and ``y`` are what it promises, else ``list``."""
    rows = all(
        type(t) is torch.Tensor and t.ndim >= 2 and not t.requires_grad
        for t in (x, y)
        if t is not None
    )
    return TensorRows if rows else list


def _data(settings: dict[str, Any], seed: int, count: int) -> _Examples:
    gen = torch.Generator().manual_seed(int(settings["data_seed"]))
    w = torch.randn(int(settings["num_features"]), 1, generator=gen)
    gen = torch.Generator().manual_seed(int(settings["data_seed"]) + seed)
    x = torch.randn(count, int(settings["num_features"]), generator=gen)
    y = x @ w + 0.5 + 0.1 * torch.randn(count, 1, generator=gen)
    return _Examples(x, y)


def write_toy_manifest(path: str | os.PathLike, settings: dict[str, Any], partition: int) -> str:
    """Write partition ``partition``'s examples as a toy manifest (CSV ``ID, x0.., y``)."""
    data = _data(settings, 1 + partition, int(settings["examples_per_client"]))
    features = [f"x{i}" for i in range(data.x.shape[1])]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["ID", *features, "y"])
        for i, (x, y) in enumerate(zip(data.x.tolist(), data.y[:, 0].tolist(), strict=True)):
            writer.writerow([f"p{partition}_{i}", *(repr(v) for v in x), repr(y)])
    return str(path)


def read_toy_manifest(path: str | os.PathLike, num_features: int) -> _Examples:
    """A toy manifest's examples; ``ValueError`` naming the file on a wrong column set."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    features = [f"x{i}" for i in range(num_features)]
    if not rows or set(rows[0]) != {"ID", *features, "y"}:
        raise ValueError(
            f"{path}: a toy manifest needs columns ID, {', '.join(features)}, y and >= 1 row"
        )
    x = torch.tensor([[float(r[f]) for f in features] for r in rows])
    y = torch.tensor([[float(r["y"])] for r in rows])
    return _Examples(x, y)


def _brain(settings: dict[str, Any], device: str = "cpu") -> ToyBrain:
    torch.manual_seed(int(settings["data_seed"]))
    model = torch.nn.Linear(int(settings["num_features"]), 1)
    lr = float(settings["lr"])
    return ToyBrain(
        modules={"model": model},
        opt_class=lambda params: torch.optim.SGD(params, lr=lr),
        run_opts={"device": device, "noprogressbar": True},
    )


def toy_settings(hparams: str | None = None, overrides: dict[str, Any] | None = None) -> dict:
    """Merge the toy defaults, an optional YAML file and ``overrides``; reject unknown keys."""
    settings = dict(TOY_DEFAULTS)
    if hparams:
        with open(hparams, encoding="utf-8") as handle:
            settings.update(load_hyperpyyaml(handle))
    for key, value in (overrides or {}).items():
        settings[key.replace("-", "_")] = value
    known = set(TOY_DEFAULTS) | FL_KEYS
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"toy task: unknown settings {unknown} (from {hparams or 'overrides'})")
    return settings


def toy_client(context: Context, settings: dict[str, Any] | None = None) -> ClientTask:
    """Build the client of partition ``context.node_config['partition-id']``.

    A data-owning node (``data-folder`` / ``data-manifest`` in its node config) reads its own
    manifest and uses its ``device``; a simulated node generates its partition.
    """
    settings = settings or toy_settings()
    node = NodeData.from_node_config(dict(context.node_config))
    if node is None:
        pid = int(context.node_config.get("partition-id", 0))
        train_set = _data(settings, 1 + pid, int(settings["examples_per_client"]))
        device = "cpu"
    else:
        train_set = read_toy_manifest(node.train_manifest, int(settings["num_features"]))
        device = node.device or "cpu"
    return ClientTask(
        brain=_brain(settings, device),
        train_set=train_set,
        train_loader_kwargs={
            "batch_size": int(settings["batch_size"]),
            "shuffle": True,
            "collate_fn": PaddedBatch,
        },
    )


def toy_server(context: Context, settings: dict[str, Any] | None = None) -> ServerTask:
    """Build the server side: starting model, config, central validation set."""
    settings = settings or toy_settings()
    config = FLConfig.from_hparams({k: v for k, v in settings.items() if k in FL_KEYS})
    return ServerTask(
        brain=_brain(settings),
        config=config,
        valid_set=_data(settings, 10_000, int(settings["valid_examples"])),
        valid_loader_kwargs={"batch_size": 64, "collate_fn": PaddedBatch},
        min_available_nodes=int(settings["num_partitions"]),
        num_partitions=int(settings["num_partitions"]),
        # the server knows each partition's size: a reply's num-examples is bounded by it
        partition_sizes=[int(settings["examples_per_client"])] * int(settings["num_partitions"]),
    )


def toy_task(hparams: str | None = None, overrides: dict[str, Any] | None = None) -> FLTask:
    """Return the toy :class:`FLTask`.

    Example
    -------
    >>> task = toy_task(overrides={"number_of_rounds": 2, "num-partitions": 3})
    >>> task.num_partitions
    3
    """
    settings = toy_settings(hparams, overrides)
    return FLTask(
        build_client=functools.partial(toy_client, settings=settings),
        build_server=functools.partial(toy_server, settings=settings),
        num_partitions=int(settings["num_partitions"]),
    )

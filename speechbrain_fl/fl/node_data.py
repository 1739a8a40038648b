"""A SuperNode's own data, device and working folder, read from its ``node_config``.

In real federated learning a node holds only its own data: ``flower-supernode --node-config``
says where it is (:class:`NodeData`, with the keys and their rules in its notes).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "NODE_KEYS",
    "NodeData",
    "bound_node",
    "current_node",
    "localize_settings",
    "pack_folder",
    "sent_to_nodes",
    "unpack_folder",
]

NODE_KEYS = ("data-folder", "data-manifest", "device", "base-model", "work-dir", "partition-id",
             "num-partitions", "hparams")  # fmt: skip

SHIP_MAX_BYTES = 64 * 2**20
"""Largest model folder the server ships whole (the tiny embedded models are a few MB)."""


@dataclass(frozen=True)
class NodeData:
    """What a data-owning SuperNode has (see the module docstring).

    Notes
    -----
    In real federated learning a node holds only its own data. A SuperNode says where it is with
    ``flower-supernode --node-config``:

    =================  ===========================================================================
    key                value =================
    =========================================================================== ``data-folder``
    the node's data root (``$data_root`` of its manifest); its training manifest is
    ``<data-folder>/train.csv`` unless ``data-manifest`` names one, or the recipe's
    ``node_manifest`` hook prepares it from the folder (a folder in the recipe's real layout)
    ``data-manifest``  a manifest (CSV in the recipe's format) of the node's own utterances/clips
    ``device``         the node's torch device (``cpu``, ``cuda:0``); default the run's ``device``
    ``base-model``     the node's own source of the frozen base (a local checkpoint folder or a hub
    ID); default: the copy the server ships (small models) or the run's ``work-dir``       where
    the node keeps what the server sent (default: the working directory) ``partition-id``   the
    node's partition (the server's identity binding, docs/fl_engine.md) =================
    ===========================================================================

    A node with ``data-folder`` or ``data-manifest`` is *data-owning*: the recipe prepares nothing
    of the corpus (no other client's data, no seed model pretraining) and its task's settings are
    the server's, sent in the setup message (:mod:`speechbrain_fl.fl.engines.flwr_apps`), with the
    data paths replaced by the node's own (:func:`localize_settings`). A node without them is a
    *simulated* node: the one corpus of the run, prepared once, partitioned by ``partition-id``
    (the simulation's convenience); both go through the same settings field,
    ``clients[partition-id]``.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "train.csv").write_text("ID\\n")
    >>> node = NodeData.from_node_config({"data-folder": str(d), "partition-id": 1})
    >>> node.train_manifest == str(d / "train.csv"), node.partition_id
    (True, 1)
    >>> NodeData.from_node_config({"partition-id": 0}) is None  # a simulated node
    True
    """

    data_folder: str | None
    manifest: str | None
    device: str | None = None
    base_model: str | None = None
    work_dir: str = "."
    partition_id: int = 0

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeData | None:
        """The node's data from its ``node_config``; ``None`` for a simulated node.

        Raises
        ------
        ValueError
            Naming the key and value of a folder or manifest that does not exist.
        """
        folder = node_config.get("data-folder") or None
        manifest = node_config.get("data-manifest") or None
        if folder is None and manifest is None:
            return None
        if folder is not None and not Path(str(folder)).is_dir():
            raise ValueError(f"node_config data-folder={folder!r}: no such folder on this node")
        if manifest is not None and not Path(str(manifest)).is_file():
            raise ValueError(f"node_config data-manifest={manifest!r}: no such file on this node")
        pid = node_config.get("partition-id", 0)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
            raise ValueError(f"node_config partition-id={pid!r} must be a non-negative integer")
        return cls(
            data_folder=str(Path(str(folder)).resolve()) if folder else None,
            manifest=str(Path(str(manifest)).resolve()) if manifest else None,
            device=str(node_config["device"]) if node_config.get("device") else None,
            base_model=str(node_config["base-model"]) if node_config.get("base-model") else None,
            work_dir=str(Path(str(node_config.get("work-dir") or ".")).resolve()),
            partition_id=pid,
        )

    @property
    def data_root(self) -> str:
        """``$data_root`` of the node's manifest: ``data-folder``, else the manifest's folder."""
        return self.data_folder or str(Path(str(self.manifest)).parent)

    @property
    def train_manifest(self) -> str:
        """``data-manifest``, else ``<data-folder>/train.csv``.

        Raises
        ------
        ValueError
            When neither exists (the recipe's ``node_manifest`` hook may prepare one).
        """
        if self.manifest is not None:
            return self.manifest
        path = Path(str(self.data_folder)) / "train.csv"
        if not path.is_file():
            raise ValueError(
                f"node_config data-folder={self.data_folder!r} holds no train.csv; give "
                "data-manifest=<csv of this node's utterances> or a folder the recipe prepares"
            )
        return str(path)

    def run_dir(self, run_id: int) -> Path:
        """``<work-dir>/sbfl_run_<run_id>``: what the server sent this node for the run."""
        return Path(self.work_dir) / f"sbfl_run_{run_id}"

    @property
    def key(self) -> dict[str, Any]:
        """A JSON key of the node's data (a task built for it is cached under it)."""
        return {"data-folder": self.data_folder, "data-manifest": self.manifest,
                "device": self.device, "base-model": self.base_model}  # fmt: skip


@dataclass(frozen=True)
class _Binding:
    node: NodeData
    setup: Mapping[str, Any] | None


_CURRENT: contextvars.ContextVar[_Binding | None] = contextvars.ContextVar(
    "sbfl_node", default=None
)


@contextlib.contextmanager
def bound_node(node: NodeData, setup: Mapping[str, Any] | None) -> Iterator[None]:
    """Within the block, :func:`current_node` is ``(node, setup)`` (a recipe factory's call).

    ``setup`` is what the server sent this node (``prepared``: the run's prepared settings as
    the recipe's ``prepare`` returned them, ``model_folder``: where the shipped model is).
    """
    token = _CURRENT.set(_Binding(node, setup))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_node() -> tuple[NodeData, Mapping[str, Any] | None] | None:
    """The data-owning node a factory is being called for, or ``None`` (server, simulation)."""
    binding = _CURRENT.get()
    return None if binding is None else (binding.node, binding.setup)


def localize_settings(
    settings: Mapping[str, Any],
    node: NodeData,
    *,
    manifest: str,
    model_folder: str | None = None,
) -> dict[str, Any]:
    """The server's :class:`~speechbrain_fl.recipe.RunSettings` as a data-owning node sees them.

    ``clients`` becomes ``[manifest] * K`` (whatever ``partition-id`` indexes, the node reads
    its own manifest and no other; K stays the run's), ``data_folder`` the node's data root,
    the server's validation/test manifests are dropped (evaluation is central), the device is
    the node's, and the model folder the node's base (``base-model``) or the shipped copy.

    Example
    -------
    >>> node = NodeData(data_folder="/n0", manifest=None, device="cuda:0")
    >>> s = localize_settings({"clients": ["/srv/a.csv", "/srv/b.csv"], "data_folder": "/srv",
    ...                        "valid_csv": "/srv/dev.csv", "test_csv": "/srv/test.csv",
    ...                        "run_opts": {"device": "cpu"}, "model": {"folder": "/srv/seed"}},
    ...                       node, manifest="/n0/train.csv", model_folder="/n0/run/model")
    >>> s["clients"], s["data_folder"], s["valid_csv"], s["run_opts"]["device"], s["model"]
    (['/n0/train.csv', '/n0/train.csv'], '/n0', '', 'cuda:0', {'folder': '/n0/run/model'})
    """
    local = copy.deepcopy(dict(settings))
    local["clients"] = [manifest] * len(local.get("clients") or [manifest])
    local["data_folder"] = node.data_root
    for key in ("valid_csv", "test_csv"):
        if key in local:
            local[key] = ""
    if node.device is not None:
        local["run_opts"] = {**local.get("run_opts", {}), "device": node.device}
    source = node.base_model or model_folder
    if isinstance(local.get("model"), dict):
        model = dict(local["model"])
        if source is not None:
            model["folder" if "folder" in model else "source"] = source
        if "cache_dir" in model:  # the node's own cache, not the server's path
            model["cache_dir"] = str(Path(node.work_dir) / "cache")
        local["model"] = model
    if "timings" in local:
        local["timings"] = {}
    return local


def sent_to_nodes(prepared: Mapping[str, Any]) -> dict[str, Any]:
    """The server's prepared result as it is sent to the nodes: no path of the server's data.

    The clients' manifests, the data root and the validation/test manifests are the server's
    files; a node gets ``K`` empty slots (it fills them with its own manifest,
    :func:`localize_settings`) and nothing else of them.

    Example
    -------
    >>> sent_to_nodes({"settings": {"clients": ["/srv/a.csv", "/srv/b.csv"], "data_folder": "/srv",
    ...                             "valid_csv": "/srv/dev.csv"}, "info": {}})["settings"]
    {'clients': ['', ''], 'data_folder': '', 'valid_csv': ''}
    """

    def strip(settings: Mapping[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(dict(settings))
        out["clients"] = [""] * len(out.get("clients") or [])
        for key in ("data_folder", "valid_csv", "test_csv"):
            if key in out:
                out[key] = ""
        return out

    if isinstance(prepared.get("settings"), Mapping):
        return {**copy.deepcopy(dict(prepared)), "settings": strip(prepared["settings"])}
    return strip(prepared)


def pack_folder(folder: str | os.PathLike, *, max_bytes: int = SHIP_MAX_BYTES) -> dict | None:
    """``{relative path: bytes}`` of a model folder to ship, or ``None`` when it is too large.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "w.bin").write_bytes(b"12")
    >>> pack_folder(d), pack_folder(d, max_bytes=1)
    ({'w.bin': b'12'}, None)
    """
    root = Path(folder)
    if not root.is_dir():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if sum(p.stat().st_size for p in files) > max_bytes:
        return None
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


def unpack_folder(files: Mapping[str, bytes], dest: str | os.PathLike) -> str:
    """Write shipped ``files`` under ``dest`` (refusing paths outside it); return ``dest``."""
    root = Path(dest).resolve()
    for name, data in files.items():
        path = (root / name).resolve()
        if root not in path.parents:
            raise ValueError(f"shipped model file {name!r} would be written outside {root}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(data))
    return str(root)

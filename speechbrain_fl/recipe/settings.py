"""The typed settings of a run: what every process of the run needs to build its side.

A federated run is prepared once (:func:`speechbrain_fl.recipe.prepare.prepare_once`), then the
client and server builders of every process (the script or ServerApp, Ray actors, SuperNodes)
read the same settings. They travel as JSON in ``<save_folder>/prepared.json``, so they are
plain data. :class:`RunSettings` holds the fields every federated recipe has; a recipe adds its
own fields in a subclass (SUPERB: labels, depths, evaluated exits). Reading a field that does
not exist is an ``AttributeError`` at the line that reads it; item access (``settings["clients"]``)
is kept for callers written against the older dict settings and raises ``KeyError`` naming an
unknown field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["RunSettings"]

T = TypeVar("T", bound="RunSettings")


@dataclass
class RunSettings:
    """The prepared run: data, clients, Brain hparams, run options and the seed model.

    Arguments
    ---------
    hparams : dict
        The hparams the recipe's Brain reads (``self.hparams.lr``): plain values only.
    run_opts : dict
        The SpeechBrain run options every Brain gets (``--device``, ``--precision``, ...).
    data_folder : str
        The corpus root (``$data_root`` of the manifests).
    clients : list of str
        One training manifest per client, in partition order (``partition-id`` indexes it).
    valid_csv, test_csv : str
        The server's validation manifest and the test manifest.
    cpus_per_client : float
        CPUs the engine gives a client (its intra-op threads).
    model : dict
        What the recipe's model builder needs (the seed folder, options).
    timings : dict
        Seconds spent preparing (corpus, manifests, pretraining).

    Example
    -------
    >>> s = RunSettings(hparams={"lr": 0.1}, run_opts={}, data_folder="d", clients=["a.csv"],
    ...                 valid_csv="v.csv", test_csv="t.csv")
    >>> RunSettings.from_dict(s.to_dict()) == s, s.num_clients
    (True, 1)
    """

    hparams: dict[str, Any] = field(default_factory=dict)
    run_opts: dict[str, Any] = field(default_factory=dict)
    data_folder: str = ""
    clients: list[str] = field(default_factory=list)
    valid_csv: str = ""
    test_csv: str = ""
    cpus_per_client: float = 1.0
    model: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        """K, the number of clients (partitions)."""
        return len(self.clients)

    def partition_sizes(self) -> list[int]:
        """Rows of each client manifest, in partition order: the server's bound on ``num-examples``.

        A client trains on (at most) its manifest's rows, so a reply that claims more examples
        than its partition holds is dropped by the server's reply checks instead of dominating
        the weighted average (``ServerTask.partition_sizes``).
        """
        sizes = []
        for manifest in self.clients:
            with open(manifest, encoding="utf-8") as handle:
                sizes.append(max(sum(1 for line in handle if line.strip()) - 1, 0))  # header
        return sizes

    @property
    def device(self) -> str:
        """The ``--device`` run option (``cpu`` when not given)."""
        return self.run_opts.get("device") or "cpu"

    def __getitem__(self, name: str) -> Any:
        """``settings["clients"]``, for callers written against the older dict settings."""
        if name not in self._names():
            raise KeyError(f"{type(self).__name__} has no field {name!r}")
        return getattr(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self._names():
            raise KeyError(f"{type(self).__name__} has no field {name!r}")
        setattr(self, name, value)

    def get(self, name: str, default: Any = None) -> Any:
        """A field's value, ``default`` when it is ``None``."""
        value = getattr(self, name) if name in self._names() else None
        return default if value is None else value

    @classmethod
    def _names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready data (``prepared.json``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[T], values: dict[str, Any]) -> T:
        """Settings from :meth:`to_dict`'s output; ``ValueError`` naming unknown fields."""
        unknown = sorted(set(values) - cls._names())
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
        return cls(**values)

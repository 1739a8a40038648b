"""Trainable groups of a model: name, component label and size (docs/design.md contract 1).

A *group* is the unit that receives its own clip budget: one trainable tensor (a LoRA A or B
matrix, a connector weight or bias) with ``group_by="parameter"``, all trainable tensors of
one module (a LoRA A and B pair, a linear layer's weight and bias) with ``group_by="module"``,
or, with ``group_by="layer_factor"``, the LoRA A factors of one numbered layer's adapted
projections together and their B factors together (two groups per transformer layer).
Each group carries a component label (``encoder``, ``connector``, ``llm`` or any label the YAML
defines by name patterns), which is what the alpha-split pools and the per-component privacy
report are keyed by.

Decisions
---------
- Module grouping of PEFT LoRA parameters: a parameter path with a segment starting with
  ``lora_`` (``...q_proj.lora_A.default.weight``) belongs to the module *before* that segment
  (``...q_proj``), so the A and B matrices of one adapted layer form one group, as the
  adapted layer is the natural "module" of a LoRA update. Any other parameter belongs to the
  module that owns it (the name without its last segment).
- ``layer_factor`` is our reading of the alpha-split paper's Table I ("L = 110": 64 encoder,
  44 LLM, 2 connector groups for Whisper large-v3-turbo + TinyLlama-1.1B, two per layer). It is
  the one grouping of that preset's trainable tensors that gives those counts and the table's
  encoder group of 30,720 values (the A factors of q, k and v: 3 x 8 x 1,280); a LoRA
  parameter's layer is its path up to the first all-digit segment (``...layers.3``), and a
  tensor of no LoRA layer (the connector's weight, its bias) is a group of its own.
- Components are assigned with :mod:`fnmatch` patterns, first matching label wins (dict order),
  so a YAML can list specific patterns before catch-alls.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Group", "Layout", "layout_from_model"]


@dataclass(frozen=True)
class Group:
    """One trainable group: the unit that gets its own clip budget.

    Arguments
    ---------
    name : str
        Group name (a parameter name, or a module name for ``group_by="module"``).
    component : str
        Component label, e.g. ``"encoder"``, ``"connector"``, ``"llm"``.
    numel : int
        Number of scalar parameters in the group (``p_l`` in the paper's Eq. 9).
    members : tuple of str
        Parameter names the group covers; empty means the group *is* the parameter ``name``.

    Example
    -------
    >>> Group("enc.q.lora_A", "encoder", 10240).parameter_names
    ('enc.q.lora_A',)
    """

    name: str
    component: str
    numel: int
    members: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"group name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.component, str) or not self.component:
            raise ValueError(f"group {self.name!r}: component must be a non-empty string")
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel <= 0:
            raise ValueError(
                f"group {self.name!r}: numel must be a positive integer, got {self.numel!r} "
                "(empty or zero-size groups cannot carry a clip budget)"
            )
        object.__setattr__(self, "members", tuple(self.members))

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The parameter names this group covers (``(name,)`` when ``members`` is empty)."""
        return self.members or (self.name,)


class Layout(Sequence):
    """Immutable, ordered sequence of :class:`Group` with unique names.

    Arguments
    ---------
    groups : iterable of Group
        The groups, in model order. Must be non-empty, names and member names unique.

    Example
    -------
    >>> lay = Layout([Group("a", "encoder", 4), Group("b", "llm", 12)])
    >>> lay.names, lay.components, lay.total_numel
    (('a', 'b'), ('encoder', 'llm'), 16)
    """

    def __init__(self, groups):
        groups = tuple(groups)
        if not groups:
            raise ValueError("a layout needs at least one group, got none")
        for g in groups:
            if not isinstance(g, Group):
                raise TypeError(f"Layout expects Group objects, got {type(g).__name__}")
        self._groups = groups
        self._by_name: dict[str, Group] = {}
        self._param_to_group: dict[str, str] = {}
        for g in groups:
            if g.name in self._by_name:
                raise ValueError(f"duplicate group name {g.name!r} in layout")
            self._by_name[g.name] = g
            for p in g.parameter_names:
                if p in self._param_to_group:
                    raise ValueError(
                        f"parameter {p!r} is in two groups: {self._param_to_group[p]!r} "
                        f"and {g.name!r}"
                    )
                self._param_to_group[p] = g.name

    # Sequence protocol
    def __getitem__(self, index):
        return self._groups[index]

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self._groups == other._groups

    def __hash__(self) -> int:
        return hash(self._groups)

    def __repr__(self) -> str:
        counts = {k: len(v) for k, v in self.by_component().items()}
        return f"Layout({len(self)} groups, {self.total_numel} params, {counts})"

    @property
    def names(self) -> tuple[str, ...]:
        """Group names in order."""
        return tuple(g.name for g in self._groups)

    @property
    def components(self) -> tuple[str, ...]:
        """Component labels in first-seen order."""
        return tuple(dict.fromkeys(g.component for g in self._groups))

    @property
    def total_numel(self) -> int:
        """Total number of parameters, ``sum_l p_l``."""
        return sum(g.numel for g in self._groups)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """All parameter names covered, in group order."""
        return tuple(self._param_to_group)

    def group(self, name: str) -> Group:
        """The group called ``name`` (``KeyError`` naming it when absent)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no group named {name!r} in the layout") from None

    def group_of(self, parameter: str) -> str:
        """The name of the group that covers ``parameter``."""
        try:
            return self._param_to_group[parameter]
        except KeyError:
            raise KeyError(f"parameter {parameter!r} is not covered by the layout") from None

    def members_of(self, name: str) -> tuple[str, ...]:
        """Parameter names of group ``name``."""
        return self.group(name).parameter_names

    def by_component(self) -> dict[str, list[Group]]:
        """Groups per component label, labels in first-seen order."""
        out: dict[str, list[Group]] = {}
        for g in self._groups:
            out.setdefault(g.component, []).append(g)
        return out

    def group_tensors(self, named: Mapping[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Collect the tensors of each group from a ``{parameter name: tensor}`` mapping.

        Arguments
        ---------
        named : mapping of str to Tensor
            Must hold exactly the layout's parameter names.

        Returns
        -------
        dict of str to list of Tensor
            ``{group name: [tensor of each member]}`` in layout order.
        """
        check_names(named.keys(), self.parameter_names, what="update")
        return {g.name: [named[p] for p in g.parameter_names] for g in self._groups}

    def to_list(self) -> list[dict]:
        """Rows ``{"name", "component", "numel"}`` (plus ``"members"`` when non-trivial)."""
        rows = []
        for g in self._groups:
            row = {"name": g.name, "component": g.component, "numel": g.numel}
            if g.members and g.members != (g.name,):
                row["members"] = list(g.members)
            rows.append(row)
        return rows

    @classmethod
    def from_list(cls, rows, *, source: str = "layout") -> Layout:
        """Build a layout from rows as written by :meth:`to_list`.

        Arguments
        ---------
        rows : list of dict
            Each with keys ``name``, ``component``, ``numel`` and optionally ``members``.
        source : str
            Where the rows came from, used in error messages (e.g. a file path).
        """
        if not isinstance(rows, list):
            raise ValueError(f"{source}: expected a JSON list of groups, got {type(rows).__name__}")
        groups = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{source}: entry {i} is not an object: {row!r}")
            missing = {"name", "component", "numel"} - row.keys()
            if missing:
                raise ValueError(f"{source}: entry {i} lacks key(s) {sorted(missing)}: {row!r}")
            extra = row.keys() - {"name", "component", "numel", "members"}
            if extra:
                raise ValueError(f"{source}: entry {i} has unknown key(s) {sorted(extra)}")
            try:
                groups.append(
                    Group(
                        row["name"], row["component"], row["numel"], tuple(row.get("members", ()))
                    )
                )
            except ValueError as err:
                raise ValueError(f"{source}: entry {i}: {err}") from None
        if not groups:
            raise ValueError(f"{source}: the layout is empty (no groups)")
        return cls(groups)

    def to_json(self, path) -> None:
        """Write the layout as a JSON list of groups to ``path``."""
        Path(path).write_text(json.dumps(self.to_list(), indent=1) + "\n")

    @classmethod
    def from_json(cls, path) -> Layout:
        """Read a layout written by :meth:`to_json`; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"layout file not found: {path}")
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"layout file {path} is not valid JSON: {err}") from None
        return cls.from_list(rows, source=f"layout file {path}")


def check_names(given, expected, *, what: str) -> None:
    """Raise ``ValueError`` listing the names missing from / unexpected in ``given``."""
    given, expected = set(given), set(expected)
    if given == expected:
        return
    missing, extra = sorted(expected - given), sorted(given - expected)
    parts = []
    if missing:
        parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    raise ValueError(f"{what} names do not match the groups: " + "; ".join(parts))


def _module_of(parameter: str) -> str:
    """Module name owning ``parameter``; PEFT LoRA A/B map to the adapted layer."""
    parts = parameter.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") and i > 0:
            return ".".join(parts[:i])
    return ".".join(parts[:-1]) or parameter


def _layer_factor_of(parameter: str) -> str:
    """``<layer>.lora_A`` / ``<layer>.lora_B`` of a LoRA parameter; any other is its own group.

    Example
    -------
    >>> _layer_factor_of("llm.model.layers.3.self_attn.v_proj.lora_B.default.weight")
    'llm.model.layers.3.lora_B'
    >>> _layer_factor_of("connector.proj.bias")
    'connector.proj.bias'
    """
    parts = parameter.split(".")
    lora = next((i for i, p in enumerate(parts) if p.startswith("lora_") and i > 0), None)
    if lora is None:
        return parameter
    layer = next((i for i, p in enumerate(parts[:lora]) if p.isdigit()), None)
    head = parts[: layer + 1] if layer is not None else parts[:lora]
    return ".".join([*head, parts[lora]])


#: ``group_by`` values of :func:`layout_from_model` and the key each groups parameters by.
GROUPINGS = {"parameter": None, "module": _module_of, "layer_factor": _layer_factor_of}


def layout_from_model(
    model: torch.nn.Module,
    *,
    components: Mapping[str, Sequence[str]],
    group_by: str = "parameter",
    default_component: str | None = None,
) -> Layout:
    """Trainable groups of ``model`` with components assigned by name patterns.

    Arguments
    ---------
    model : torch.nn.Module
        Only parameters with ``requires_grad`` are included.
    components : mapping of str to list of str
        ``{label: [fnmatch pattern, ...]}``; the first label (in dict order) with a matching
        pattern wins.
    group_by : str
        ``"parameter"`` (one group per tensor), ``"module"`` (one group per module; LoRA A and
        B of one adapted layer together) or ``"layer_factor"`` (per numbered layer, its LoRA A
        factors together and its B factors together; the paper's Table I, module docstring).
    default_component : str, optional
        Label for parameters no pattern matches; when ``None`` such a parameter is an error.

    Returns
    -------
    Layout

    Example
    -------
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    >>> lay = layout_from_model(net, components={"encoder": ["0.*"], "llm": ["1.*"]},
    ...                         group_by="module")
    >>> [(g.name, g.component, g.numel) for g in lay]
    [('0', 'encoder', 8), ('1', 'llm', 3)]
    """
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {sorted(GROUPINGS)}, got {group_by!r}")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")

    def label_of(name: str) -> str:
        for label, patterns in components.items():
            if isinstance(patterns, str):
                patterns = [patterns]
            if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                return label
        if default_component is None:
            raise ValueError(
                f"parameter {name!r} matches no component pattern in {dict(components)!r} "
                "and no default_component is set"
            )
        return default_component

    if group_by == "parameter":
        return Layout(Group(n, label_of(n), int(p.numel())) for n, p in params)

    modules: dict[str, list[tuple[str, int, str]]] = {}
    for n, p in params:
        modules.setdefault(GROUPINGS[group_by](n), []).append((n, int(p.numel()), label_of(n)))
    groups = []
    for mod, members in modules.items():
        labels = {lab for _, _, lab in members}
        if len(labels) > 1:
            raise ValueError(
                f"module {mod!r} mixes components {sorted(labels)}; use group_by='parameter' "
                "or fix the component patterns"
            )
        groups.append(
            Group(mod, labels.pop(), sum(k for _, k, _ in members), tuple(n for n, _, _ in members))
        )
    return Layout(groups)

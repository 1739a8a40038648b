"""The federated parameters of a model: listing, copying in, fingerprinting.

Only the ``requires_grad`` parameters of a module cross the wire (docs/design.md contract 6): LoRA
matrices, the connector, an unfrozen encoder. This module is the one place that lists them,
copies tensors into them (the client before and after local training, the server after each
round, the recipe before its final evaluation, a checkpoint loader) and fingerprints them (the
server state records the fingerprint of the starting point so a resume from another seed model
is refused). It imports torch only, so model code can use it without Flower.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

__all__ = [
    "ParameterIndex",
    "load_trainable",
    "params_fingerprint",
    "trainable_parameters",
    "trainable_state",
]


def trainable_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Return ``{name: parameter}`` for the ``requires_grad`` parameters of ``module``.

    Example
    -------
    >>> lin = torch.nn.Linear(2, 1); lin.bias.requires_grad_(False)
    Parameter containing:
    ...
    >>> list(trainable_parameters(lin))
    ['weight']
    """
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the trainable parameters (what a round sends).

    Example
    -------
    >>> state = trainable_state(torch.nn.Linear(2, 1))
    >>> sorted(state), state["weight"].requires_grad
    (['bias', 'weight'], False)
    """
    return {n: p.detach().cpu().clone() for n, p in trainable_parameters(module).items()}


class ParameterIndex:
    """A module's parameters, listed once and listed again only when its structure changed.

    :meth:`get` returns ``(trainable_parameters(module), list(module.parameters()))`` as they
    are now. They are rebuilt by walking the module (``named_parameters``) when the structure
    signature changed since the last walk: for every submodule of that walk, its children and
    its parameters (by identity, so a replaced, added or removed submodule or parameter
    counts) and each parameter's ``requires_grad`` (a frozen or unfrozen tensor counts). The
    index holds the objects it compared, so an identity cannot be reused by a new object.
    Checking the signature reads each submodule's ``_modules`` and ``_parameters`` dicts,
    without ``named_modules``' recursive generators and name strings: the per-round listing a
    client makes three times a round (before training, for the delta, after the reset).

    Example
    -------
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> index = ParameterIndex(net)
    >>> trainable, params = index.get()
    >>> sorted(trainable), len(params)
    (['0.bias', '0.weight', '1.bias', '1.weight'], 4)
    >>> _ = net[0].requires_grad_(False)
    >>> sorted(index.get()[0])
    ['1.bias', '1.weight']
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._modules: list[torch.nn.Module] = []
        self._held: list[object] = []
        self._signature: list[object] = []
        self._trainable: dict[str, torch.nn.Parameter] = {}
        self._parameters: list[torch.nn.Parameter] = []

    def _current(self) -> list[object]:
        signature: list[object] = []
        for m in self._modules:
            signature.append(len(m._modules))
            signature.extend(map(id, m._modules.values()))
            signature.append(len(m._parameters))
            for p in m._parameters.values():
                signature.append(id(p))
                signature.append(p is not None and p.requires_grad)
        return signature

    def get(self) -> tuple[dict[str, torch.nn.Parameter], list[torch.nn.Parameter]]:
        """``(trainable_parameters(module), list(module.parameters()))`` (see the class)."""
        if not self._modules or self._current() != self._signature:
            named = list(self.module.named_parameters())
            self._trainable = {n: p for n, p in named if p.requires_grad}
            self._parameters = [p for _, p in named]
            self._modules = list(self.module.modules())
            self._held = [
                v for m in self._modules for d in (m._modules, m._parameters) for v in d.values()
            ]
            self._signature = self._current()
        return self._trainable, self._parameters


def load_trainable(
    module: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    strict: bool = False,
    own: Mapping[str, torch.nn.Parameter] | None = None,
) -> None:
    """Copy ``state`` into the trainable parameters of ``module`` (device and dtype kept).

    Arguments
    ---------
    module : torch.nn.Module
        The model (e.g. a Brain's ``modules``).
    state : mapping of str to Tensor
        Named tensors; each name must be a trainable parameter of ``module`` with the same shape.
    strict : bool
        Also require every trainable parameter to be in ``state`` (a whole checkpoint, not a
        partial update).
    own : mapping of str to Parameter, optional
        ``trainable_parameters(module)`` when the caller has it (e.g. from a
        :class:`ParameterIndex`); listed from ``module`` otherwise.

    Raises
    ------
    ValueError
        Naming tensors that are not trainable parameters (or, with ``strict``, the missing
        ones), or the first shape mismatch.

    Example
    -------
    >>> lin = torch.nn.Linear(2, 1)
    >>> load_trainable(lin, {"bias": torch.ones(1)})
    >>> lin.bias.item()
    1.0
    """
    if own is None:
        own = trainable_parameters(module)
    if not (state.keys() == own.keys() or (not strict and state.keys() <= own.keys())):
        unknown = sorted(set(state) - set(own))
        missing = sorted(set(own) - set(state)) if strict else []
        if unknown or missing:
            raise ValueError(
                f"trainable state mismatch: unexpected {unknown[:5]} ({len(unknown)}), "
                f"missing {missing[:5]} ({len(missing)})"
            )
    params = [own[name] for name in state]
    values = list(state.values())
    same = True
    for name, param, value in zip(state, params, values, strict=True):
        if value.shape != param.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(param.shape)}")
        same = same and value.dtype == param.dtype and value.device == param.device
    with torch.no_grad():
        if same and params:  # one call; the same copies (no conversion to make)
            torch._foreach_copy_(params, values)
            return
        for param, value in zip(params, values, strict=True):
            param.copy_(value.to(param.device, param.dtype))


def params_fingerprint(params: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors (names, dtypes, shapes and bytes, in name order).

    Saved with the server state as the fingerprint of the run's starting point: a resume whose
    starting model differs (e.g. a re-pretrained seed model) is refused instead of continuing
    someone else's parameters.

    Example
    -------
    >>> a = params_fingerprint({"w": torch.zeros(2)})
    >>> a == params_fingerprint({"w": torch.zeros(2)}), a == params_fingerprint({"w": torch.ones(2)})
    (True, False)
    """
    digest = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

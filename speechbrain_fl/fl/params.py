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

__all__ = ["load_trainable", "params_fingerprint", "trainable_parameters", "trainable_state"]


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


def load_trainable(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = False
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
    own = trainable_parameters(module)
    unknown = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state)) if strict else []
    if unknown or missing:
        raise ValueError(
            f"trainable state mismatch: unexpected {unknown[:5]} ({len(unknown)}), "
            f"missing {missing[:5]} ({len(missing)})"
        )
    with torch.no_grad():
        for name, value in state.items():
            param = own[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(param.shape)}")
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

"""The fingerprint of a model's frozen base, and the refusal of a node whose base differs.

Only the trainable tensors cross the wire (:mod:`speechbrain_fl.fl.params`); the frozen base
(a pretrained encoder, an LLM under its LoRA adapters, buffers) is built by every node from its
own configured source. Two nodes whose bases differ would train silently apart, so before the
first round the server sends the fingerprint of its frozen base and a node compares it with the
fingerprint of the base it built (:func:`check_base_fingerprint`): a mismatch refuses the node
with :class:`BaseModelMismatch`, naming both digests.

The fingerprint is SHA-256 over the frozen tensors in name order:

    fingerprint = SHA256( || over name in sorted(F) of  name | dtype | shape | bytes(tensor) )

where F is every entry of ``module.state_dict()`` that is not a ``requires_grad`` parameter
(frozen parameters and buffers), the same encoding as
:func:`speechbrain_fl.fl.params.params_fingerprint` uses for the trainable starting point.
"""

from __future__ import annotations

import torch

from speechbrain_fl.fl.params import params_fingerprint, trainable_parameters

__all__ = ["BaseModelMismatch", "check_base_fingerprint", "frozen_fingerprint", "frozen_state"]


class BaseModelMismatch(RuntimeError):
    """A node's frozen base differs from the server's: the node is refused."""


def frozen_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen tensors of ``module``: its state dict without the trainable parameters.

    Example
    -------
    >>> lin = torch.nn.Linear(2, 1); _ = lin.bias.requires_grad_(False)
    >>> sorted(frozen_state(lin))
    ['bias']
    """
    trainable = set(trainable_parameters(module))
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in trainable}


def frozen_fingerprint(module: torch.nn.Module) -> str:
    """SHA-256 of the frozen tensors of ``module`` (formula in the module docstring).

    Example
    -------
    >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    >>> _ = [p.requires_grad_(False) for p in (a.weight, b.weight)]
    >>> with torch.no_grad():
    ...     _ = a.weight.fill_(1.0); _ = b.weight.fill_(1.0); _ = b.bias.fill_(5.0)
    >>> frozen_fingerprint(a) == frozen_fingerprint(b)  # the trainable bias does not count
    True
    """
    return params_fingerprint(frozen_state(module))


def check_base_fingerprint(expected: str, module: torch.nn.Module, *, where: str = "") -> str:
    """Return the fingerprint of ``module``'s frozen base; raise if it is not ``expected``.

    Raises
    ------
    BaseModelMismatch
        Naming both digests and ``where`` (the node and the base's source).
    """
    actual = frozen_fingerprint(module)
    if actual != expected:
        raise BaseModelMismatch(
            f"frozen base model fingerprint {actual[:16]}... differs from the server's "
            f"{expected[:16]}...{' (' + where + ')' if where else ''}: this node built another "
            "base model (another checkpoint, hub revision or seed); it is refused"
        )
    return actual

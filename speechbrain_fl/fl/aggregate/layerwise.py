"""Layer-wise partial aggregation for depth-heterogeneous clients (multi-exit wav2vec 2.0).

In the early-exit federated paper (``early-exit-federated-wav2vec2`` in the repository's papers
folder) each client trains layers 1..L_i only (its L_max) and the head of exit L_i; the server
aggregates "each Transformer layer independently ... only clients that trained it contribute
... weights proportional to local data size n_i and maximum trained depth L_i". The equation
itself was lost from the paper's text; this module is OUR reading of it, keyed by parameter
name (a reply carries exactly the tensors its client trained, see
:attr:`speechbrain_fl.fl.clientapp.train.ClientTask.partial`):

    for every parameter p:  S_p = {i : p in reply_i}
    w_i^p = a_i / sum_{j in S_p} a_j
    delta^p = sum_{i in S_p} w_i^p delta_i^p          (p untouched when S_p is empty)

with ``a_i = n_i * L_i`` (``depth_aware``, the paper's), ``n_i`` (``samples``) or ``1``
(``uniform``). Per Transformer layer l this is the paper's S_l (all tensors of a layer are
trained together); an exit head is averaged over the clients that trained that exit; the
parameters below the Transformer (CNN, projection, positional convolution) over every
participant that trained them; layers no client trained keep their global value.

``fedavg_full`` is our reading of the paper's "conventional FedAvg" baseline under depth
heterogeneity: every client returns a full model in which the layers it did not train are the
global values it received (a zero delta), and the server takes the n_i-weighted mean over all
participants, so untrained copies dilute the trained ones:

    delta^p = sum_{i in S_p} n_i delta_i^p / sum_{all i} n_i

``n_i`` is the reply's ``num-examples`` and ``L_i`` its ``exit-depth`` metric.

:class:`ServerMomentum` (ours) wraps either rule with server-side momentum (FedAvgM) on its
aggregate delta, per parameter.

Privacy: none of these rules is sensitivity-bounded for the engine's Gaussian mechanism (noise
N(0, (sigma C / n)^2) with n the expected cohort size): the per-parameter denominator
sum_{j in S_p} a_j depends on which (private) clients trained p, and a client alone in S_p
moves p by its whole clipped delta (weight 1), not by C/n. A private run with these rules is
refused (``dp_sensitivity_bounded = False``, reason in ``dp_refusal``).

Example
-------
>>> from speechbrain_fl.fl.aggregate.rules import ClientUpdate, get_rule
>>> a = ClientUpdate(0, {"l1": torch.ones(1)}, {"num-examples": 10, "exit-depth": 3})
>>> b = ClientUpdate(1, {"l1": torch.zeros(1), "l4": torch.ones(1)},
...                  {"num-examples": 10, "exit-depth": 6})
>>> agg = get_rule("layerwise")([a, b], expected_cohort_size=2)
>>> round(agg["l1"].item(), 4), agg["l4"].item()
(0.3333, 1.0)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speechbrain_fl.fl.aggregate.update import ClientUpdate

__all__ = [
    "DEPTH_METRIC",
    "WEIGHTINGS",
    "ServerMomentum",
    "fedavg_full",
    "layerwise_rule",
    "trained_sets",
]

#: Reply metric holding the client's L_max (the exit it trained to).
DEPTH_METRIC = "exit-depth"
WEIGHTINGS = ("depth_aware", "samples", "uniform")

_DP_REASON = (
    "layer-wise partial aggregation averages each parameter over the clients that trained it; "
    "that denominator depends on the private cohort, and a client alone in a layer's set moves "
    "it by its whole update, so the C/n sensitivity the Gaussian noise is calibrated to does "
    "not hold"
)


def trained_sets(updates: Sequence[ClientUpdate]) -> dict[str, list[int]]:
    """Return ``{parameter name: indices of the updates that carry it}`` (the S_p sets)."""
    sets: dict[str, list[int]] = {}
    for index, update in enumerate(updates):
        for name in update.delta:
            sets.setdefault(name, []).append(index)
    return sets


def _depth(update: ClientUpdate) -> float:
    if DEPTH_METRIC not in update.metrics:
        raise ValueError(
            f"node {update.node_id}: depth-aware weighting needs the reply metric "
            f"{DEPTH_METRIC!r} (the client's L_max); got {sorted(update.metrics)}"
        )
    depth = float(update.metrics[DEPTH_METRIC])
    if depth <= 0:
        raise ValueError(f"node {update.node_id}: {DEPTH_METRIC}={depth} must be > 0")
    return depth


def client_weight(update: ClientUpdate, weighting: str) -> float:
    """a_i: ``n_i * L_i`` (depth_aware), ``n_i`` (samples) or 1 (uniform)."""
    if weighting == "depth_aware":
        return update.num_examples * _depth(update)
    if weighting == "samples":
        return update.num_examples
    if weighting == "uniform":
        return 1.0
    raise ValueError(f"weighting: {weighting!r} must be one of {list(WEIGHTINGS)}")


def layerwise_rule(weighting: str = "depth_aware"):
    """Return the layer-wise partial aggregation rule with the given client weighting.

    Arguments
    ---------
    weighting : str
        ``depth_aware`` (n_i L_i, the paper's), ``samples`` (n_i) or ``uniform`` (ours).

    Returns
    -------
    callable
        ``rule(updates, *, expected_cohort_size) -> {name: aggregate delta}``.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting: {weighting!r} must be one of {list(WEIGHTINGS)}")

    def rule(
        updates: Sequence[ClientUpdate], *, expected_cohort_size: float
    ) -> dict[str, torch.Tensor]:
        del expected_cohort_size
        weights = [client_weight(u, weighting) for u in updates]
        out: dict[str, torch.Tensor] = {}
        for name, members in trained_sets(updates).items():
            total = sum(weights[i] for i in members)
            if total <= 0:
                raise ValueError(f"parameter {name!r}: client weights sum to {total}")
            acc = None
            for i in members:
                term = updates[i].delta[name].detach().to(torch.float64) * (weights[i] / total)
                acc = term if acc is None else acc + term
            out[name] = acc
        return out

    rule.__name__ = f"layerwise_{weighting}"
    rule.__doc__ = f"Layer-wise partial aggregation, {weighting} weighting (module docstring)."
    rule.accepts_partial = True  # type: ignore[attr-defined]
    rule.dp_sensitivity_bounded = False  # type: ignore[attr-defined]
    rule.dp_refusal = _DP_REASON  # type: ignore[attr-defined]
    rule.weighting = weighting  # type: ignore[attr-defined]
    return rule


def fedavg_full(
    updates: Sequence[ClientUpdate], *, expected_cohort_size: float
) -> dict[str, torch.Tensor]:
    """n_i-weighted mean over all participants, untrained tensors counted as returned unchanged.

    Example
    -------
    >>> a = ClientUpdate(0, {"l1": torch.ones(1)}, {"num-examples": 1})
    >>> b = ClientUpdate(1, {"l1": torch.ones(1), "l4": torch.ones(1)}, {"num-examples": 3})
    >>> agg = fedavg_full([a, b], expected_cohort_size=2)
    >>> agg["l1"].item(), agg["l4"].item()
    (1.0, 0.75)
    """
    del expected_cohort_size
    weights = [u.num_examples for u in updates]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"num-examples must sum to > 0, got {weights}")
    out: dict[str, torch.Tensor] = {}
    for name, members in trained_sets(updates).items():
        acc = None
        for i in members:
            term = updates[i].delta[name].detach().to(torch.float64) * (weights[i] / total)
            acc = term if acc is None else acc + term
        out[name] = acc
    return out


fedavg_full.accepts_partial = True  # type: ignore[attr-defined]
fedavg_full.dp_sensitivity_bounded = False  # type: ignore[attr-defined]
fedavg_full.dp_refusal = _DP_REASON.replace(  # type: ignore[attr-defined]
    "layer-wise partial aggregation averages each parameter over the clients that trained it",
    "fedavg_full weights by the clients' example counts n_i",
)


class ServerMomentum:
    """Server-side momentum (FedAvgM) on an aggregation rule's delta, per parameter.

    The server treats the rule's aggregate delta Delta_p^t as a pseudo-gradient step and keeps a
    momentum buffer per parameter (Hsu et al. 2019, "Measuring the effects of non-identical
    data distribution for federated visual classification"; Reddi et al. 2021, "Adaptive
    federated optimization")::

        v_p^t = beta * v_p^(t-1) + Delta_p^t        (v_p^0 = 0)
        step_p^t = eta * v_p^t

    for every parameter p in this round's aggregate; a parameter no client trained this round
    (absent from the aggregate, e.g. layers 4-6 in a round with no deep client) does not move
    and keeps its buffer. ``beta = 0, eta = 1`` is the wrapped rule unchanged. The wrapper
    carries the rule's flags (``accepts_partial``, ``dp_sensitivity_bounded``,
    ``dp_refusal``, ``weighting``), so a private run is refused as the rule itself would be.

    The buffers live in this object (one per run: build it in the server's process); a run
    resumed from its server state starts them again at zero.

    Arguments
    ---------
    rule : callable
        ``rule(updates, *, expected_cohort_size) -> {name: delta}``.
    momentum : float
        beta in [0, 1).
    server_lr : float
        eta > 0.

    Example
    -------
    >>> m = ServerMomentum(fedavg_full, momentum=0.5)
    >>> u = [ClientUpdate(0, {"w": torch.ones(1)}, {"num-examples": 1})]
    >>> [m(u, expected_cohort_size=1)["w"].item() for _ in range(3)]
    [1.0, 1.5, 1.75]
    """

    def __init__(self, rule, *, momentum: float, server_lr: float = 1.0) -> None:
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"server_momentum: {momentum!r} must be in [0, 1)")
        if not float(server_lr) > 0.0:
            raise ValueError(f"server_lr: {server_lr!r} must be > 0")
        self.rule = rule
        self.momentum = float(momentum)
        self.server_lr = float(server_lr)
        self.buffers: dict[str, torch.Tensor] = {}
        for flag in ("accepts_partial", "dp_sensitivity_bounded", "dp_refusal", "weighting"):
            if hasattr(rule, flag):
                setattr(self, flag, getattr(rule, flag))
        self.__name__ = f"{getattr(rule, '__name__', 'rule')}_momentum"

    def __call__(
        self, updates: Sequence[ClientUpdate], *, expected_cohort_size: float
    ) -> dict[str, torch.Tensor]:
        aggregate = self.rule(updates, expected_cohort_size=expected_cohort_size)
        out: dict[str, torch.Tensor] = {}
        for name, delta in aggregate.items():
            delta = delta.detach().to(torch.float64)
            previous = self.buffers.get(name)
            buffer = delta if previous is None else self.momentum * previous + delta
            self.buffers[name] = buffer
            out[name] = self.server_lr * buffer
        return out


#: The rules of this module by name; :mod:`speechbrain_fl.fl.aggregate.rules` puts them in its registry.
RULES = {
    "layerwise": layerwise_rule("depth_aware"),
    "layerwise_depth_aware": layerwise_rule("depth_aware"),
    "layerwise_samples": layerwise_rule("samples"),
    "layerwise_uniform": layerwise_rule("uniform"),
    "fedavg_full": fedavg_full,
}


def rule_name(aggregation: str, weighting: str) -> str:
    """Registry name for the recipe keys ``aggregation`` (layerwise | fedavg_full) + ``weighting``.

    Example
    -------
    >>> rule_name("layerwise", "samples"), rule_name("fedavg_full", "depth_aware")
    ('layerwise_samples', 'fedavg_full')
    """
    if aggregation == "fedavg_full":
        return "fedavg_full"
    if aggregation != "layerwise":
        raise ValueError(f"aggregation: {aggregation!r} must be 'layerwise' or 'fedavg_full'")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting: {weighting!r} must be one of {list(WEIGHTINGS)}")
    return f"layerwise_{weighting}"

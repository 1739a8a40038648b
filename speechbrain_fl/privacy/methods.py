"""The privacy methods: one class per method, holding its own settings and their checks.

A class is a method's one home: its :attr:`~PrivacyMethod.name` is the name ``--method`` takes
and results.json records, and the budget registry (:mod:`speechbrain_fl.privacy.budgets`)
allocates its clip budgets under that name. A recipe's hparams build it::

    method: !new:speechbrain_fl.privacy.methods.AlphaSplit
        clip: !ref <clip>
        noise_multiplier: !ref <noise_multiplier>
        alpha: 0.05

``--method flat`` on the command line names a class: the recipe kit builds it from the hparams'
keys where the hparams are loaded (:func:`privacy_method`), so recipes and the engine only see
method objects. A new method is a subclass with a ``name`` (registered on definition).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

#: registered name -> class (every subclass with a ``name``, on definition)
_CLASSES: dict[str, type] = {}

__all__ = [
    "AlphaSplit",
    "FedAvg",
    "Flat",
    "PFLDim",
    "PFLDimEMA",
    "PFLUnifEMA",
    "PFLUniform",
    "PrivacyMethod",
    "privacy_method",
]


@dataclass
class PrivacyMethod:
    """A clipping method: every update clipped to a total L2 norm C, noise sigma C / n.

    Arguments
    ---------
    clip : float, optional
        Total clip norm C (the recipe's ``clip``).
    noise_multiplier : float
        sigma of the Gaussian mechanism; 0 clips without noise (a non-private run).
    """

    name: ClassVar[str] = ""
    #: Whether the method clips updates (FedAvg does not, so it can add no noise).
    clips: ClassVar[bool] = True
    clip: float | None = None
    noise_multiplier: float = 0.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _CLASSES[cls.name] = cls

    def __str__(self) -> str:
        return self.name

    def check(self) -> None:
        """Refuse settings the method cannot run with (``ValueError`` naming the key).

        Example
        -------
        >>> Flat(clip=0.0).check()
        Traceback (most recent call last):
        ...
        ValueError: clip: 0.0 must be > 0 for method flat
        """
        from .budgets import budget_methods  # the live registry: plug-in allocators included

        if self.name not in budget_methods():
            raise ValueError(f"method: {self.name!r} has no budget allocator; registered: "
                             f"{list(budget_methods())}")  # fmt: skip
        if self.clip is None or self.clip <= 0:
            raise ValueError(f"clip: {self.clip!r} must be > 0 for method {self.name}")

    def settings(self) -> dict[str, Any]:
        """The method as hparams keys (``method`` = its name, then its own settings).

        Example
        -------
        >>> Flat(clip=1.0, noise_multiplier=0.1).settings()
        {'method': 'flat', 'alpha': None, 'clip': 1.0, 'noise_multiplier': 0.1}
        """
        return {"method": self.name, "alpha": None, **dataclasses.asdict(self)}

    def replace(self, **settings: Any) -> PrivacyMethod:
        """A copy with ``settings`` changed; settings this method does not hold are ignored.

        Example
        -------
        >>> AlphaSplit(clip=1.0, alpha=0.05).replace(alpha=0.2, ema_beta=0.1)
        AlphaSplit(clip=1.0, noise_multiplier=0.0, alpha=0.2)
        """
        own = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v for k, v in settings.items() if k in own})


@dataclass
class FedAvg(PrivacyMethod):
    """FedAvg (McMahan et al. 2017): no clipping and no noise."""

    name: ClassVar[str] = "fedavg"
    clips: ClassVar[bool] = False

    def check(self) -> None:
        """Refuse noise: FedAvg clips nothing, so noise would bound no sensitivity."""
        if self.noise_multiplier:
            raise ValueError(
                f"method: fedavg clips nothing, so noise_multiplier: {self.noise_multiplier} "
                "bounds no sensitivity; choose a clipping method (flat, pfl_dim, ...) or set "
                "noise_multiplier: 0"
            )

    def settings(self) -> dict[str, Any]:
        """No clip, no noise, no alpha, whatever the hparams' own keys say."""
        return {"method": self.name, "alpha": None, "clip": None, "noise_multiplier": 0.0}


@dataclass
class Flat(PrivacyMethod):
    """Flat: DP-FedAvg, one clip norm C over the concatenated update (paper Eq. 3-4)."""

    name: ClassVar[str] = "flat"


@dataclass
class PFLUniform(PrivacyMethod):
    """PFL-Uniform: equal per-group budgets C_l = C / sqrt(L) (Euclidean-tight)."""

    name: ClassVar[str] = "pfl_uniform"


@dataclass
class PFLDim(PrivacyMethod):
    """PFL-Dim: size-proportional budgets C_l = C sqrt(d_l / d) (paper Eq. 9)."""

    name: ClassVar[str] = "pfl_dim"


@dataclass
class _EMA(PrivacyMethod):
    """An adaptive method: base weights adapted by an EMA of per-group norms (Eq. 10-11).

    Arguments
    ---------
    ema_beta : float
        EMA rate beta: s_l <- (1 - beta) s_l + beta ||u_l||.
    ema_gamma : float
        Exponent gamma of the weights w_l ~ s_l^gamma.
    ema_warmup_rounds : int
        Rounds the budgets stay at their base weights.
    ema_signal : str
        ``noisy`` (the released aggregate, inside the DP guarantee) or ``raw`` (the clients'
        reported norms, outside it).
    """

    ema_beta: float = 0.2
    ema_gamma: float = 0.75
    ema_warmup_rounds: int = 3
    ema_signal: str = "noisy"


@dataclass
class PFLDimEMA(_EMA):
    """PFL-Dim+EMA: size-proportional base weights adapted by the EMA (Eq. 10-11)."""

    name: ClassVar[str] = "pfl_dim_ema"


@dataclass
class PFLUnifEMA(_EMA):
    """PFL-Unif+EMA: uniform base weights adapted by the EMA (Eq. 10-11)."""

    name: ClassVar[str] = "pfl_unif_ema"


@dataclass
class AlphaSplit(PrivacyMethod):
    """alpha-split: encoder and LLM+connector pools, C sqrt(alpha), C sqrt(1 - alpha) (Eq. 12-14).

    Arguments
    ---------
    alpha : float, optional
        The encoder's share of C^2, in (0, 1).
    """

    name: ClassVar[str] = "alpha_split"
    alpha: float | None = None

    def check(self) -> None:
        """The clip, then alpha: a number in (0, 1)."""
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"alpha: {alpha!r} must be a number in (0, 1) for alpha_split")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha: {alpha!r} must be in (0, 1) for alpha_split")
        super().check()


def privacy_method(name: str, **settings: Any) -> PrivacyMethod:
    """The method object of the registered method ``name``, given the settings it holds.

    Settings the method does not hold are ignored (a recipe's hparams carry every method's
    keys), so ``privacy_method(hparams["method"], **hparams)`` works for any of them.

    Example
    -------
    >>> privacy_method("pfl_dim", clip=1.0, noise_multiplier=0.1, alpha=0.05)
    PFLDim(clip=1.0, noise_multiplier=0.1)
    >>> str(privacy_method("alpha_split", alpha=0.1))
    'alpha_split'
    """
    if name not in _CLASSES:
        raise ValueError(f"method: {name!r} is not one of {sorted(_CLASSES)}")
    cls = _CLASSES[name]
    own = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in settings.items() if k in own})

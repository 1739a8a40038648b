"""The privacy methods as objects: one small class per method, holding its own settings.

A recipe's hparams may build the method with HyperPyYAML instead of naming it, e.g.::

    method: !new:speechbrain_fl.privacy.methods.AlphaSplit
        clip: !ref <clip>
        noise_multiplier: !ref <noise_multiplier>
        alpha: 0.05

:meth:`speechbrain_fl.fl.settings.config.FLConfig.from_hparams` accepts such an object as well as the
registered name (``method: flat``, ``--method flat`` on the command line). Each class carries
the settings its method reads and nothing else: the clip norm C, the noise multiplier sigma,
the encoder share alpha of alpha-split, the EMA rate, exponent, warm-up and signal of the
adaptive methods. Its :attr:`~PrivacyMethod.name` is the name the budget registry
(:mod:`speechbrain_fl.privacy.budgets`) knows it by, the one results.json records as
``method``; ``str(method)`` is that name.

Code that reads ``hparams["method"]`` takes either form through :func:`method_name` (the
registered name of an object or a name) and :func:`with_settings` (a setting changed after the
hparams were loaded, e.g. ``alpha: auto`` resolved by the norm profiling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "AlphaSplit",
    "FedAvg",
    "Flat",
    "PFLDim",
    "PFLDimEMA",
    "PFLUnifEMA",
    "PFLUniform",
    "PrivacyMethod",
    "method_name",
    "privacy_method",
    "with_settings",
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
    clip: float | None = None
    noise_multiplier: float = 0.0

    def __str__(self) -> str:
        return self.name

    def settings(self) -> dict[str, Any]:
        """The method as hparams keys (``method`` = its name, then its own settings).

        Example
        -------
        >>> AlphaSplit(clip=1.0, noise_multiplier=0.1, alpha=0.05).settings()
        {'method': 'alpha_split', 'clip': 1.0, 'noise_multiplier': 0.1, 'alpha': 0.05}
        """
        return {"method": self.name, **dataclasses.asdict(self)}

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
    """FedAvg (McMahan et al. 2017): no clipping and no noise (``clip`` must stay None)."""

    name: ClassVar[str] = "fedavg"


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


_CLASSES = {cls.name: cls for cls in (FedAvg, Flat, PFLUniform, PFLDim, PFLDimEMA, PFLUnifEMA,
                                      AlphaSplit)}  # fmt: skip


def privacy_method(name: str, **settings: Any) -> PrivacyMethod:
    """The method object of a built-in method ``name``, given the settings it holds.

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


def method_name(method: str | PrivacyMethod) -> str:
    """The registered name of ``hparams["method"]``: an object's :attr:`~PrivacyMethod.name`,
    or the name itself (``--method flat`` on the command line replaces the object by a name).

    Example
    -------
    >>> method_name(Flat(clip=1.0)), method_name("pfl_dim")
    ('flat', 'pfl_dim')
    """
    if isinstance(method, PrivacyMethod):
        return method.name
    if isinstance(method, str):
        return method
    raise ValueError(
        f"method: {method!r} must be a registered method name or an object of "
        "speechbrain_fl.privacy.methods (method: !new:speechbrain_fl.privacy.methods.Flat)"
    )


def with_settings(method: str | PrivacyMethod, **settings: Any) -> str | PrivacyMethod:
    """``hparams["method"]`` with ``settings`` changed: an object is rebuilt with those it
    holds (:meth:`PrivacyMethod.replace`); a name is returned as is, its settings being the
    hparams' own keys (which the caller changes alongside).

    Example
    -------
    >>> with_settings(AlphaSplit(clip=1.0, alpha="auto"), alpha=0.3).alpha
    0.3
    >>> with_settings("alpha_split", alpha=0.3)
    'alpha_split'
    """
    if isinstance(method, PrivacyMethod):
        return method.replace(**settings)
    method_name(method)  # a bad value is named here
    return method

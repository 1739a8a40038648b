"""Renyi-DP accounting with Opacus's RDP analysis (Mironov et al. 2019, Balle et al. 2020).

The figures are Opacus's ``RDPAccountant``'s: the RDP of one sampled Gaussian step at the
orders :data:`RDP_ORDERS`, times ``T`` (RDP composes additively), converted to (epsilon, delta).

They need only Opacus's RDP analysis, ``opacus/accountants/analysis/rdp.py``, a module of pure
functions over NumPy and SciPy; importing it the usual way runs the ``opacus`` package's
``__init__`` first (its ``PrivacyEngine``, the grad samplers, the optimisers, and
``torch._dynamo``), which costs more than the RDP arithmetic itself. :func:`_rdp_analysis` loads that one file of the installed Opacus on its own
instead (the same code; the package's own module when ``opacus`` is already imported, the usual
import should the file ever need its package), at Opacus's default orders :data:`RDP_ORDERS`
(``RDPAccountant.DEFAULT_ALPHAS``, checked equal in tests/unit/test_privacy_accounting_rdp.py).
Why hand-written: Python imports a submodule only after its package's ``__init__``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .accountant import Accountant

__all__ = ["RDP_ORDERS", "RDPAccountant", "rdp_epsilon"]

#: Opacus's default RDP orders (``opacus.accountants.RDPAccountant.DEFAULT_ALPHAS`` of Opacus
#: 1.5-1.6), the orders of every RDP figure here.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
#: Where Opacus keeps its RDP analysis, and the name it is loaded under by :func:`_rdp_analysis`.
_RDP_MODULE = "opacus.accountants.analysis.rdp"
_RDP_STANDALONE = "speechbrain_fl.privacy._opacus_rdp_analysis"


@functools.lru_cache(maxsize=1)
def _rdp_analysis() -> ModuleType:
    """Opacus's RDP analysis module (``compute_rdp``, ``get_privacy_spent``), see the module
    docstring: Opacus's own when the package is imported, else the installed file loaded on its
    own (under a private name, so a later ``import opacus`` builds its own as usual); the usual
    import when that fails (no such file, a file that needs its package or raises)."""
    loaded = sys.modules.get(_RDP_MODULE)
    if loaded is not None:
        return loaded
    try:
        package = importlib.util.find_spec("opacus")
        folder = (package.submodule_search_locations or [None])[0] if package else None
        path = Path(folder, "accountants", "analysis", "rdp.py") if folder else None
        if path is not None and path.is_file():
            spec = importlib.util.spec_from_file_location(_RDP_STANDALONE, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if callable(getattr(module, "compute_rdp", None)) and callable(
                getattr(module, "get_privacy_spent", None)
            ):
                return module
    except Exception:  # noqa: BLE001  (e.g. a relative import: the file needs its package)
        pass
    return importlib.import_module(_RDP_MODULE)


@functools.lru_cache(maxsize=256)
def _rdp_per_step(sampling_rate: float, noise_multiplier: float):
    """RDP of one step of the sampled Gaussian mechanism at Opacus's default orders (cached).

    RDP composes additively, ``RDP_T(alpha) = T RDP_1(alpha)`` (Mironov 2017, Prop. 1), which is
    how Opacus's ``compute_rdp`` scales ``steps`` too, so ``T`` rounds cost one multiplication
    and the (eps, delta) conversion instead of the per-order series again.
    """
    return _rdp_analysis().compute_rdp(
        q=sampling_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(RDP_ORDERS)
    )


def rdp_epsilon(sampling_rate: float, noise_multiplier: float, rounds: int, delta: float) -> float:
    """Epsilon of ``T`` steps from their RDP, Opacus's conversion (Balle et al. 2020, Thm. 21).

    ``eps = min_alpha [T RDP_1(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) /
    (alpha - 1)]`` over :data:`RDP_ORDERS`. The per-step RDP is :func:`_rdp_per_step`'s (cached
    per ``(q, sigma)``); the conversion is Opacus's ``get_privacy_spent``, so the figure equals
    ``RDPAccountant.get_epsilon`` bit for bit (tests/unit/test_fl_speed.py).
    """
    rdp = _rdp_per_step(float(sampling_rate), float(noise_multiplier)) * int(rounds)
    eps, _ = _rdp_analysis().get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return float(eps)


class RDPAccountant(Accountant):
    """``"rdp"``: Opacus's ``RDPAccountant`` arithmetic, an upper bound on epsilon.

    About 10% above the PLD's at the recipes' settings (11.54 vs 10.46 at ``q=0.5, sigma=1,
    T=10, delta=1e-5``; tests/unit/test_privacy_accounting.py); every report carries it beside
    the default as a cross-check.

    Example
    -------
    >>> round(RDPAccountant().epsilon(0.04, 1.5, 2250, 1e-5), 6)
    7.329111
    """

    name = "rdp"
    opacus_mechanism = "rdp"

    def epsilon(
        self, sampling_rate: float, noise_multiplier: float, rounds: int, delta: float
    ) -> float:
        """See :func:`rdp_epsilon`."""
        return rdp_epsilon(sampling_rate, noise_multiplier, rounds, delta)

"""The accountants a configuration can name, and :func:`create_accountant` to get one by name."""

from __future__ import annotations

from .accountant import Accountant
from .pld import PLDAccountant
from .prv import PRVAccountant
from .rdp import RDPAccountant

__all__ = ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "OPACUS_ACCOUNTANTS", "create_accountant"]

_ACCOUNTANTS: dict[str, type[Accountant]] = {
    cls.name: cls for cls in (PLDAccountant, RDPAccountant, PRVAccountant)
}
#: The names ``accountant=`` accepts.
ACCOUNTANTS = tuple(_ACCOUNTANTS)
#: The accountants Opacus's ``PrivacyEngine`` knows (DP-SGD paths that account with it).
OPACUS_ACCOUNTANTS = tuple(name for name, cls in _ACCOUNTANTS.items() if cls.opacus_mechanism)
DEFAULT_ACCOUNTANT = "pld"


def create_accountant(name: str) -> Accountant:
    """The accountant called ``name`` (one of :data:`ACCOUNTANTS`).

    Example
    -------
    >>> create_accountant("rdp").opacus_mechanism, ACCOUNTANTS
    ('rdp', ('pld', 'rdp', 'prv'))
    """
    try:
        return _ACCOUNTANTS[name]()
    except KeyError:
        raise ValueError(f"unknown accountant {name!r}; expected one of {ACCOUNTANTS}") from None

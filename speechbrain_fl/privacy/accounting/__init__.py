"""(epsilon, delta) accounting: PLD by default, RDP beside it (docs/design.md contract 5).

One FL round is one application of the sampled Gaussian mechanism: each client joins the cohort
with probability ``q`` (Poisson sampling), its clipped update has L2 sensitivity ``C`` and the
server adds ``N(0, (sigma C)^2)`` to the sum (``(sigma C / n)^2`` on the mean). ``T`` rounds
compose, so the guarantee is an accountant evaluated at ``(sigma, q, T)``: client-level DP for a
population of ``K = n / q`` clients under add/remove adjacency.

Accountants (``accountant=``, :mod:`.registry`; each implements :class:`.accountant.Accountant`):

- ``"pld"`` (default, :mod:`.pld`): the privacy loss distribution of Google's ``dp-accounting``,
  pessimistic, so an upper bound on the exact epsilon and the tightest of the three here.
- ``"rdp"`` (:mod:`.rdp`): Opacus's ``RDPAccountant``; an upper bound too, looser by about 10%
  at the recipes' settings. Every report carries it beside the default as a cross-check
  (``epsilon_rdp``).
- ``"prv"`` (:mod:`.prv`): Opacus's ``PRVAccountant`` (Gopi et al. 2021).

The figure itself (:mod:`.epsilon`, cached per distinct ``(q, sigma, T, delta, accountant)``),
the sigma search (:mod:`.calibration`), the running accountant (:mod:`.running`), the
per-component figures (:mod:`.components`), the cohort extrapolation (:mod:`.extrapolation`) and
a run's report (:mod:`.report`) use whichever accountant they are given, so a run's sigma, its
epsilon and its extrapolation agree.

Opacus and dp-accounting are imported on first use, inside the functions that call them: a
non-private run never needs them, and importing them lengthens its start-up; the RDP figures load Opacus's RDP analysis file on its own
(:mod:`.rdp`).
"""

from .accountant import Accountant
from .calibration import noise_multiplier_for_epsilon
from .checks import LARGE_EPSILON
from .components import component_privacy, effective_noise_multiplier, effective_noise_multipliers
from .epsilon import compute_epsilon
from .extrapolation import extrapolate_privacy
from .pld import PLD_COARSE_ABOVE, PLD_DISCRETIZATION, pld_interval
from .rdp import RDP_ORDERS
from .registry import ACCOUNTANTS, DEFAULT_ACCOUNTANT, OPACUS_ACCOUNTANTS, create_accountant
from .report import REPORT_POOLS, privacy_report
from .running import PrivacyAccountant

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "DEFAULT_ACCOUNTANT",
    "LARGE_EPSILON",
    "OPACUS_ACCOUNTANTS",
    "PLD_COARSE_ABOVE",
    "PLD_DISCRETIZATION",
    "PrivacyAccountant",
    "RDP_ORDERS",
    "REPORT_POOLS",
    "compute_epsilon",
    "component_privacy",
    "create_accountant",
    "effective_noise_multiplier",
    "effective_noise_multipliers",
    "extrapolate_privacy",
    "noise_multiplier_for_epsilon",
    "pld_interval",
    "privacy_report",
]

# The per-process caches behind the figures, here so that a test can clear them and count their
# hits: the epsilon per (q, sigma, T, delta, accountant), the one-step PLD per (q, sigma, grid) and
# the one-step RDP per (q, sigma).
from .epsilon import _epsilon as _epsilon  # noqa: E402
from .pld import _pld_one_step as _pld_one_step  # noqa: E402
from .rdp import _rdp_per_step as _rdp_per_step  # noqa: E402

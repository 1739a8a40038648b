"""The PLD's grid width (``accounting.pld_interval``): still an upper bound, and as tight as the
fine grid to the digits reported."""

import pytest

from speechbrain_fl.privacy import accounting
from speechbrain_fl.privacy.accounting import compute_epsilon, pld_interval


def _fine_pld(q, sigma, rounds, delta):
    """dp-accounting's PLDAccountant on the guarantee's event with its default 1e-4 grid."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=accounting.PLD_DISCRETIZATION,
    )
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc.compose(dp_accounting.SelfComposedDpEvent(step, rounds))
    return float(acc.get_epsilon(delta))


def test_interval_is_the_default_below_the_threshold_and_proportional_above():
    assert pld_interval(0.5) == pld_interval(accounting.PLD_COARSE_ABOVE)
    assert pld_interval(0.5) == accounting.PLD_DISCRETIZATION
    assert pld_interval(8.0) == pytest.approx(4 * pld_interval(2.0))


@pytest.mark.parametrize(
    "q, sigma, rounds",
    [
        (0.5, 1.0, 10),  # benchmarks/fl_overhead.py's DP setting (eps ~10)
        (0.5, 2.0, 3),  # just above the threshold
        (0.05, 1.0, 300),  # many rounds
        (0.3, 0.5, 10),  # eps ~23
        (0.15, 0.1, 8),  # the MLS method table's setting (eps ~338)
    ],
)
def test_wider_grid_stays_an_upper_bound_within_1e4_relative(q, sigma, rounds):
    eps_rdp = compute_epsilon(
        sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=1e-5, accountant="rdp",
        warn=False,
    )  # fmt: skip
    assert pld_interval(eps_rdp) > accounting.PLD_DISCRETIZATION  # the grid did widen
    got = compute_epsilon(
        sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=1e-5, warn=False
    )
    fine = _fine_pld(q, sigma, rounds, 1e-5)
    assert got >= fine  # pessimistic at any width: never below the fine grid's bound
    assert (got - fine) / fine < 1e-4
    assert got <= eps_rdp  # and still tighter than RDP

"""The accountant's cached epsilon equals Opacus's, computed once per distinct value."""

import pytest
from opacus.accountants import RDPAccountant

from speechbrain_fl.privacy import accounting
from speechbrain_fl.privacy.accounting import PrivacyAccountant, compute_epsilon


@pytest.mark.parametrize(
    ("q", "sigma", "rounds"), [(0.5, 1.0, 10), (0.04, 1.5, 2250), (1.0, 0.7, 3), (0.01, 3.0, 1)]
)
def test_cached_rdp_epsilon_equals_opacus(q, sigma, rounds):
    opacus = RDPAccountant()
    opacus.history = [(sigma, q, rounds)]
    expected = opacus.get_epsilon(delta=1e-5)
    got = compute_epsilon(sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=1e-5)
    assert got == expected  # the same arithmetic, not an approximation


def test_epsilon_computed_once_per_round():
    accounting._epsilon.cache_clear()
    accounting._rdp_per_step.cache_clear()
    acc = PrivacyAccountant(sampling_rate=0.3, noise_multiplier=1.1, delta=1e-6)
    values = []
    for _ in range(5):
        acc.step(1)
        values += [acc.epsilon(), acc.epsilon(), acc.epsilon_after(1)]
    info = accounting._epsilon.cache_info()
    assert info.misses == 6  # rounds 1..5 and the look-ahead to 6
    assert accounting._rdp_per_step.cache_info().misses == 1
    assert values == sorted(values) and values[-2] > values[0] > 0


def test_prv_accountant_not_cached_wrongly():
    a = compute_epsilon(
        sampling_rate=0.5, noise_multiplier=1.0, rounds=10, delta=1e-5, accountant="prv"
    )
    b = compute_epsilon(sampling_rate=0.5, noise_multiplier=1.0, rounds=10, delta=1e-5)
    assert a != b and abs(a - b) / b < 0.2  # PRV and RDP: different bounds, same ballpark

"""Opacus's RDP analysis without the ``opacus`` package import (privacy/accounting/rdp.py).

A private federated run's RDP figures (the per-round figure, the report's cross-check, the PLD
grid's width) come from ``opacus/accountants/analysis/rdp.py`` loaded on its own: the same
epsilons as Opacus's ``RDPAccountant``, without the ~0.3 s of the package's ``__init__``.
"""

import importlib
import json
import subprocess
import sys
import textwrap

from opacus.accountants import RDPAccountant

import speechbrain_fl.privacy.accounting as accounting
from speechbrain_fl.privacy.accounting import rdp as rdp_module

#: (q, sigma, T, delta): the fl_overhead benchmark's, a long low-rate run, MLS's small sigma,
#: q = 1.
SETTINGS = [
    (0.5, 1.0, 10, 1e-5),
    (0.05, 1.0, 1000, 1e-5),
    (0.15, 0.1, 8, 1e-5),
    (1.0, 2.0, 5, 1e-6),
]


def test_rdp_orders_are_opacus_defaults():
    assert list(accounting.RDP_ORDERS) == list(RDPAccountant.DEFAULT_ALPHAS)


def test_fresh_process_does_not_import_opacus_and_matches_its_accountant():
    code = textwrap.dedent(
        f"""
        import json, sys
        from speechbrain_fl.privacy.accounting import compute_epsilon
        from speechbrain_fl.privacy.accounting.rdp import _rdp_analysis
        rows = [
            [compute_epsilon(sampling_rate=q, noise_multiplier=s, rounds=t, delta=d,
                             accountant=a, warn=False) for a in ("rdp", "pld")]
            for q, s, t, d in {SETTINGS!r}
        ]
        print(json.dumps({{"opacus": "opacus" in sys.modules, "rows": rows,
                          "module": _rdp_analysis().__name__}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["opacus"] is False  # the package's __init__ never ran
    assert out["module"] == rdp_module._RDP_STANDALONE
    for (q, sigma, rounds, delta), (rdp, pld) in zip(SETTINGS, out["rows"], strict=True):
        reference = RDPAccountant()
        reference.history = [(sigma, q, rounds)]
        assert rdp == reference.get_epsilon(delta=delta)  # bit for bit
        # the PLD grid's width comes from the RDP figure: the same guarantee as in-process
        assert pld == accounting.compute_epsilon(
            sampling_rate=q, noise_multiplier=sigma, rounds=rounds, delta=delta, warn=False
        )


def test_the_package_module_is_used_once_opacus_is_imported():
    # this process imported opacus (above): its own module, not a second copy
    assert rdp_module._rdp_analysis.__wrapped__() is sys.modules[rdp_module._RDP_MODULE]


def test_a_file_that_needs_its_package_falls_back_to_the_import(tmp_path, monkeypatch):
    fake = tmp_path / "opacus"
    (fake / "accountants" / "analysis").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "accountants" / "analysis" / "rdp.py").write_text("from . import missing\n")
    real = sys.modules[rdp_module._RDP_MODULE]

    class Spec:
        submodule_search_locations = [str(fake)]

    monkeypatch.delitem(sys.modules, rdp_module._RDP_MODULE)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec())
    imported = []
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name) or real)
    assert rdp_module._rdp_analysis.__wrapped__() is real
    assert imported == [rdp_module._RDP_MODULE]

"""The per-round state file: the same bytes as ``torch.save``, RNG states restored exactly.

:func:`speechbrain_fl.fl.state.atomic_torch_save` serialises into memory and writes once; the
Python ``random`` state is kept as one ``uint32`` array (:func:`capture_rng_states`), and a
state saved by an earlier version (the tuple of 625 ints) still restores.
"""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from speechbrain_fl.fl.state import (
    atomic_torch_save,
    capture_rng_states,
    load_state,
    restore_rng_states,
)


def test_atomic_save_writes_torch_saves_bytes(tmp_path):
    obj = {"round": 3, "params": {"w": torch.randn(40, 30), "b": torch.zeros(3)}, "x": [1, "a"]}
    expected = io.BytesIO()
    torch.save(obj, expected)
    atomic_torch_save(obj, tmp_path / "s.pt")
    assert (tmp_path / "s.pt").read_bytes() == expected.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pt"]  # no temporary left


def _draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_saved_rng_states_restore_every_stream(tmp_path):
    random.gauss(0, 1)  # a cached gauss value is part of Python's state
    states = capture_rng_states()
    assert isinstance(states["python"][1], np.ndarray) and states["python"][1].dtype == np.uint32
    atomic_torch_save({"rng": states}, tmp_path / "s.pt")
    expected = _draws()
    _draws()  # move every stream on
    restore_rng_states(load_state(tmp_path / "s.pt")["rng"])
    assert _draws() == expected


def test_a_state_of_the_earlier_tuple_form_restores():
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    old["python"] = random.getstate()  # (version, tuple of 625 ints, gauss)
    expected = _draws()
    restore_rng_states(old)
    assert _draws() == expected

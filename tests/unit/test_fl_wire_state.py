"""The per-round state file: the same bytes as ``torch.save``, RNG states restored exactly.

:func:`speechbrain_fl.fl.serverapp.state.atomic_torch_save` serialises into memory and writes once; the
Python ``random`` state is kept as one ``uint32`` array (:func:`capture_rng_states`), and a
state saved by an earlier version (the tuple of 625 ints) still restores. A failed or killed
write (one ``O_DSYNC`` write to a temporary, then ``os.replace``) leaves the previous state whole.
"""

from __future__ import annotations

import errno
import io
import os
import random
import subprocess
import sys

import numpy as np
import torch

import speechbrain_fl.utils.atomic as atomic
from speechbrain_fl.fl.serverapp.state import (
    atomic_torch_save,
    capture_rng_states,
    load_state,
    restore_rng_states,
)
from speechbrain_fl.utils.atomic import sweep_stale_temporaries


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


def test_a_failed_write_keeps_the_previous_state_and_no_temporary(tmp_path, monkeypatch):
    atomic_torch_save({"round": 1}, tmp_path / "s.pt")

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "write", full_disk)
    try:
        atomic_torch_save({"round": 2}, tmp_path / "s.pt")
    except OSError as err:
        assert err.errno == errno.ENOSPC
    else:
        raise AssertionError("the failed write did not raise")
    monkeypatch.setattr(atomic.os, "write", os.write)
    assert load_state(tmp_path / "s.pt")["round"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pt"]


KILL_MID_WRITE = """
import os, sys
import torch
import speechbrain_fl.utils.atomic as atomic
from speechbrain_fl.fl.serverapp.state import atomic_torch_save
path = sys.argv[1]
atomic_torch_save({"round": 1, "params": {"w": torch.ones(5000)}}, path)
real_write = os.write
def half_then_die(fd, data):
    real_write(fd, memoryview(data)[: len(data) // 2])
    os._exit(9)  # the process dies with round 2 half written
atomic.os.write = half_then_die
atomic_torch_save({"round": 2, "params": {"w": torch.full((5000,), 2.0)}}, path)
"""


def test_a_process_killed_mid_write_leaves_the_previous_whole_state(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = tmp_path / "server_state.pt"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MID_WRITE, str(path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    state = load_state(path)  # the previous round's, whole
    assert state["round"] == 1 and torch.equal(state["params"]["w"], torch.ones(5000))
    (stale,) = [p for p in tmp_path.iterdir() if p.name != path.name]
    assert 0 < stale.stat().st_size < path.stat().st_size  # the half-written temporary
    assert sweep_stale_temporaries(tmp_path) == [stale]  # what the next run's start removes

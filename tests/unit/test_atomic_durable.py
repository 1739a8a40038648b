"""The server state's commit syncs its folder after the rename (a durable commit)."""

import os
import stat

import pytest
import torch

from speechbrain_fl.fl.serverapp.state import atomic_torch_save, load_state
from speechbrain_fl.utils import atomic


def _record_fsyncs(monkeypatch):
    """Record, for each ``os.fsync``, whether its descriptor was a folder."""
    seen: list[bool] = []
    real = os.fsync

    def fsync(fd):
        seen.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    return seen


@pytest.mark.skipif(os.name != "posix", reason="folders are synced on POSIX only")
def test_state_commit_syncs_its_folder_after_the_rename(tmp_path, monkeypatch):
    seen = _record_fsyncs(monkeypatch)
    order: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(
        atomic.os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1]
    )
    real_sync = atomic.fsync_folder
    monkeypatch.setattr(
        atomic, "fsync_folder", lambda f: (order.append(f"sync {f}"), real_sync(f))[1]
    )
    path = tmp_path / "server_state.pt"
    atomic_torch_save({"round": 3, "params": {"w": torch.ones(2)}}, path)
    assert order == ["replace", f"sync {tmp_path}"]
    assert True in seen  # a folder's descriptor reached fsync
    assert load_state(path)["round"] == 3


@pytest.mark.skipif(os.name != "posix", reason="folders are synced on POSIX only")
def test_plain_atomic_write_does_not_sync_the_folder(tmp_path, monkeypatch):
    seen = _record_fsyncs(monkeypatch)
    atomic.atomic_write_bytes(tmp_path / "x.bin", b"abc")
    assert True not in seen
    assert (tmp_path / "x.bin").read_bytes() == b"abc"


def test_fsync_folder_names_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic.fsync_folder(tmp_path / "missing")

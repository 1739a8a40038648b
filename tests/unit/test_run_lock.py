"""One run per output folder: a real second process is refused at once.

Before: a second identical private command on a running folder "resumed after round 202" and
both runs wrote into one rounds.csv (598 noisy releases, 400 accounted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from flwr.app import Context, RecordDict

from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_server, toy_settings
from speechbrain_fl.utils import LOCK_FILE, RunLockedError, hold_run_lock

HOLD = textwrap.dedent(
    """
    import sys, time
    from speechbrain_fl.utils import hold_run_lock
    with hold_run_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)
TAKE = textwrap.dedent(
    """
    import sys
    from speechbrain_fl.utils import hold_run_lock
    with hold_run_lock(sys.argv[1]):
        print("took it")
    """
)


def _python(code, *args, **kwargs):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def _holder(folder, seconds=60):
    proc = _python(HOLD, folder, seconds)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_naming_the_folder_and_pid(tmp_path):
    with hold_run_lock(tmp_path):
        proc = _python(TAKE, tmp_path)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "took it" not in out
    assert "RunLockedError" in err
    assert f"output folder {tmp_path.resolve()} is in use by another run (pid {os.getpid()}" in err


def test_the_lock_is_released_when_the_holder_is_killed(tmp_path):
    proc = _holder(tmp_path)
    try:
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == proc.pid and record["command"].endswith(f"{tmp_path} 60")
        with pytest.raises(RunLockedError, match=f"pid {proc.pid}"):
            with hold_run_lock(tmp_path):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with hold_run_lock(tmp_path) as folder:  # the OS dropped the dead holder's lock
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_reentrant_in_one_process_and_released_by_the_outermost(tmp_path):
    with hold_run_lock(tmp_path):
        with hold_run_lock(tmp_path / "."):  # the same folder, another spelling
            pass
        proc = _python(TAKE, tmp_path)  # still held by the outer block
        assert proc.wait(timeout=60) != 0
    proc = _python(TAKE, tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "took it" in out


def test_run_server_stops_at_once_when_another_run_holds_the_folder(tmp_path):
    """The engine's server loop (simulation and ``flwr run`` alike) takes the lock first."""
    proc = _holder(tmp_path)
    try:
        context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
        task = toy_server(context, toy_settings(overrides={"output_folder": str(tmp_path)}))
        started = time.time()
        with pytest.raises(RunLockedError, match=f"{tmp_path.resolve()}.*pid {proc.pid}"):
            run_server(None, task)
        assert time.time() - started < 5
        assert not (tmp_path / "rounds.csv").exists()  # no work done, nothing written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

"""speechbrain_fl.utils.gc_freeze: the run's frozen heap and the freeze at exit."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest

from speechbrain_fl.utils.gc_freeze import freeze_at_exit, frozen_heap, refreeze


def test_frozen_heap_nests_and_unfreezes():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        with frozen_heap():
            keep = [[] for _ in range(10)]  # lists are always tracked
            assert refreeze()
            assert gc.get_freeze_count() >= outer + len(keep)
        assert gc.get_freeze_count() > 0  # the inner block leaves the unfreeze to the outer
    assert gc.get_freeze_count() == 0
    assert not refreeze()


# A child process: an atexit handler registered BEFORE freeze_at_exit (so it runs after the
# freeze: atexit is last-in first-out) records the freeze count; a logging file handler, a
# weakref.finalize and a TemporaryDirectory must still do their exit work.
_CHILD = textwrap.dedent(
    """
    import atexit, gc, logging, sys, tempfile, weakref
    out = sys.argv[1]
    def record():
        with open(out + ".count", "w") as f:
            f.write(str(gc.get_freeze_count()))
    atexit.register(record)
    from speechbrain_fl.utils.gc_freeze import freeze_at_exit
    print(freeze_at_exit(), freeze_at_exit())
    handler = logging.FileHandler(out + ".log", delay=False)
    logging.getLogger("child").addHandler(handler)
    logging.getLogger("child").warning("written before exit")
    class Obj: pass
    o = Obj(); o.self = o  # a cycle alive at exit
    weakref.finalize(o, lambda: open(out + ".finalized", "w").write("yes"))
    tmp = tempfile.TemporaryDirectory(); open(tmp.name + "/f", "w").write("x")
    open(out + ".tmp", "w").write(tmp.name)
    """
)


def _run_child(tmp_path, env_extra):
    env = {**os.environ, **env_extra}
    base = str(tmp_path / "child")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, base], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return base, proc.stdout.split()


@pytest.mark.parametrize("full_gc", [False, True])
def test_freeze_at_exit_keeps_exit_work(tmp_path, full_gc):
    base, printed = _run_child(tmp_path, {"SB_FL_EXIT_GC": "1" if full_gc else "0"})
    assert printed == (["False", "False"] if full_gc else ["True", "True"])
    count = int(open(base + ".count").read())
    assert (count == 0) if full_gc else (count > 0)
    assert open(base + ".log").read().strip() == "written before exit"  # logging flushed
    assert open(base + ".finalized").read() == "yes"  # weakref.finalize ran at exit
    assert not os.path.exists(open(base + ".tmp").read())  # TemporaryDirectory removed


def test_freeze_at_exit_registers_once():
    assert freeze_at_exit() == (os.environ.get("SB_FL_EXIT_GC") != "1")
    import atexit

    before = atexit._ncallbacks()
    freeze_at_exit()
    assert atexit._ncallbacks() == before

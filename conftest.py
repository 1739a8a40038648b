"""Shared pytest configuration: keep tests on CPU, single-threaded, and reproducible."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402

import pytest  # noqa: E402


def _drop_broken_lazy_modules():
    """Drop SpeechBrain's lazy stubs for optional integrations that are not installed.

    Hypothesis reads ``__file__`` of every module in ``sys.modules``; SpeechBrain registers lazy
    modules for optional integrations (e.g. k2) whose attribute access raises ImportError when
    the dependency is absent, which would crash any property test run after SpeechBrain was
    imported in the same session.
    """
    for name, module in list(sys.modules.items()):
        try:
            getattr(module, "__file__", None)
        except ImportError:
            del sys.modules[name]


@pytest.fixture(autouse=True)
def drop_broken_lazy_modules():
    """Autouse wrapper of :func:`_drop_broken_lazy_modules`, before every test."""
    _drop_broken_lazy_modules()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Drop the stubs before Hypothesis's own collection hook scans ``sys.modules``."""
    _drop_broken_lazy_modules()

"""Readable recipe logs: third-party DEBUG noise off, one-off lines once per process.

SpeechBrain's default log config sends every logger at DEBUG to ``<output_folder>/log.txt``;
:func:`install_filters` keeps that minus what a reader does not need (what, in its notes),
without changing a logger the user configured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

__all__ = [
    "QUIET_LOGGERS",
    "TORCHVISION_WARNING",
    "STARTUP_LINES",
    "DropMessage",
    "FileOncePerProcess",
    "OncePerProcess",
    "install_filters",
    "muted",
    "quiet_recipe_logs",
]

#: Third-party loggers raised to WARNING in a recipe run (their DEBUG/INFO is not ours).
QUIET_LOGGERS = (
    "matplotlib",
    "PIL",
    "urllib3",
    "fsspec",
    "filelock",
    "asyncio",
    "numba",
    "h5py",
    "httpx",
    "httpcore",
    "git",
    "graphviz",
    "hyperpyyaml",
    "torio",
    "opacus",
    "ray",
    "absl",
)
#: SpeechBrain's import-time warning about figures no recipe saves.
TORCHVISION_WARNING = "torchvision is not available - cannot save figures"
_MODEL_STATISTICS = " Model Statistics:"
#: Beginnings of the lines ``speechbrain.core`` logs at INFO for every Brain it builds.
STARTUP_LINES = (
    "Run option ",
    "Gradscaler enabled: ",
    "Using training precision: ",
    "Using evaluation precision: ",
    "Since debug mode is active, switching checkpointer",
)
_VERBOSE_ENV = "SB_FL_VERBOSE_LOGS"


class DropMessage(logging.Filter):
    """Drop the records whose message is exactly ``text``.

    Example
    -------
    >>> f = DropMessage("noise")
    >>> f.filter(logging.makeLogRecord({"msg": "noise"})), f.filter(logging.makeLogRecord({"msg": "x"}))
    (False, True)
    """  # noqa: E501

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return record.getMessage() != self.text


class OncePerProcess(logging.Filter):
    """Let the first record containing ``marker`` through, drop the later ones.

    Arguments
    ---------
    marker : str
        A piece of the message (``" Model Statistics:"``).
    on_first : callable, optional
        Called once, when the first such record passes (e.g. turn off loading bars).

    Example
    -------
    >>> f = OncePerProcess("Model Statistics")
    >>> [f.filter(logging.makeLogRecord({"msg": m})) for m in
    ...  ("A Model Statistics: 1", "other", "B Model Statistics: 1")]
    [True, True, False]
    """

    def __init__(self, marker: str, on_first=None) -> None:
        super().__init__()
        self.marker = marker
        self.on_first = on_first
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        if self.marker not in str(record.msg):
            return True
        if self.seen:
            return False
        self.seen = True
        if self.on_first is not None:
            self.on_first()
        return True


class FileOncePerProcess(logging.Filter):
    """Send the records starting with one of ``prefixes`` to the log files only, once each.

    The first record of each distinct message is handed to the ``logging.FileHandler``
    instances on its logger's path (SpeechBrain's ``log.txt``), not to the console; a repeat
    goes nowhere. Other records pass unchanged.

    Arguments
    ---------
    prefixes : tuple of str
        Beginnings of the messages concerned (:data:`STARTUP_LINES`).

    Example
    -------
    >>> f = FileOncePerProcess(("Run option ",))
    >>> rec = lambda m: logging.makeLogRecord({"msg": m, "levelno": logging.INFO})
    >>> [f.filter(rec(m)) for m in ("Run option lr from hparams is used", "other")]
    [False, True]
    >>> sorted(f.seen)
    ['Run option lr from hparams is used']
    """

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        message = record.getMessage()
        if not message.startswith(self.prefixes):
            return True
        if message not in self.seen:
            self.seen.add(message)
            for handler in _file_handlers(logging.getLogger(record.name)):
                if record.levelno >= handler.level:
                    handler.handle(record)
        return False


def _file_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The file handlers a record of ``logger`` propagates to."""
    found: list[logging.Handler] = []
    node: logging.Logger | None = logger
    while node is not None:
        found += [h for h in node.handlers if isinstance(h, logging.FileHandler)]
        node = node.parent if node.propagate else None
    return found


@contextlib.contextmanager
def muted(*names: str, level: int = logging.WARNING) -> Iterator[None]:
    """Loggers ``names`` below ``level`` muted inside the block (e.g. a load whose seed line a
    second load repeats).

    Example
    -------
    >>> with muted("speechbrain.utils.seed"):
    ...     logging.getLogger("speechbrain.utils.seed").isEnabledFor(logging.INFO)
    False
    """
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(level, logger.level))
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved, strict=True):
            logger.setLevel(old)


def _has_filter(logger: logging.Logger, kind: type, attr: str, value: str) -> bool:
    return any(isinstance(f, kind) and getattr(f, attr) == value for f in logger.filters)


def _hf_bars_off() -> None:
    """Turn off ``transformers``' (and ``huggingface_hub``'s) progress bars in this process,
    without importing either.

    Already imported: their own switches. Not imported (a run that loads no Hugging Face model,
    e.g. the toy task, which should not import ``transformers`` only to switch its bars off): ``HF_HUB_DISABLE_PROGRESS_BARS=1``, unless set
    already, which both read when imported (``transformers``' ``_tqdm_active`` starts as ``not
    huggingface_hub.utils.are_progress_bars_disabled()``).
    """
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def install_filters() -> None:
    """Install this process's filters (idempotent; :mod:`speechbrain_fl` runs it on import):
    SpeechBrain's torchvision warning dropped, its "Model Statistics" once per process (then
    the Hugging Face bars off), its Brain start-up lines to the log files once per process.

    Notes
    -----
    SpeechBrain's default log config (``speechbrain/log-config.yaml``) sends every logger at DEBUG
    to ``<output_folder>/log.txt``. We keep that, minus what a person reading the log does not need
    (:func:`install_filters` runs when :mod:`speechbrain_fl` is imported, in every process;
    :func:`quiet_recipe_logs` when the recipe kit loads a run's hparams, in every process of a
    recipe run):

    - the DEBUG/INFO chatter of libraries the recipes use but do not drive (:data:`QUIET_LOGGERS`:
      ``matplotlib.font_manager`` alone wrote 2,190 lines of a 744 KB debug-run log), raised to
      WARNING (their warnings and errors still show);
    - SpeechBrain's "<Brain> Model Statistics" block, which ``Brain.__init__`` logs for every
      Brain: a federated process builds one Brain per client (and the server's, the evaluation's),
      so it is shown once per process (:class:`OncePerProcess`), and the Hugging Face
      loading/writing bars (``transformers``' own progress bars) stop once the first Brain is
      built: the first model load shows them, the per-client rebuilds of the same model do not;
    - SpeechBrain's start-up lines of every Brain (:data:`STARTUP_LINES`: "Run option max_grad_norm
      from hparams is used", "Gradscaler enabled: ...", the precisions, ...), logged by
      ``Brain.__init__`` for each client's Brain (515 of the ~618 console lines of a default MLS
      run): each distinct line goes to the log files (``log.txt``) once per process and never to
      the console (:class:`FileOncePerProcess`), which keeps the progress bar, the round lines and
      the results;
    - SpeechBrain's import-time warning "torchvision is not available - cannot save figures": it is
      about ``ProgressSampleLogger``'s image saving, which no recipe here uses (our figures are
      matplotlib's). It is dropped by a filter that :mod:`speechbrain_fl` installs when it is
      imported (before SpeechBrain when a process starts from our package: Flower's apps, the
      console script); :func:`install_filters` installs it again, idempotently.

    Nothing here changes a logger the user configured: levels are only raised on loggers left at
    NOTSET, and ``SB_FL_VERBOSE_LOGS=1`` in the environment leaves everything as SpeechBrain sets
    it.

    Example
    -------
    >>> install_filters(); install_filters()
    >>> sum(isinstance(f, DropMessage) for f in
    ...     logging.getLogger("speechbrain.utils.train_logger").filters)
    1
    """
    if os.environ.get(_VERBOSE_ENV, "") == "1":
        return
    logger = logging.getLogger("speechbrain.utils.train_logger")
    if not _has_filter(logger, DropMessage, "text", TORCHVISION_WARNING):
        logger.addFilter(DropMessage(TORCHVISION_WARNING))
    core = logging.getLogger("speechbrain.core")
    if not _has_filter(core, OncePerProcess, "marker", _MODEL_STATISTICS):
        core.addFilter(OncePerProcess(_MODEL_STATISTICS, on_first=_hf_bars_off))
    if not any(isinstance(f, FileOncePerProcess) for f in core.filters):
        core.addFilter(FileOncePerProcess(STARTUP_LINES))


def quiet_recipe_logs() -> None:
    """Apply the module docstring's rules in this process (idempotent).

    Example
    -------
    >>> quiet_recipe_logs()
    >>> logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.DEBUG)
    False
    """
    if os.environ.get(_VERBOSE_ENV, "") == "1":
        return
    install_filters()
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)

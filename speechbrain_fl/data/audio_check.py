"""Unreadable audio: found at preparation where a header read is enough, skipped at read time
where it is not.

A corpus of real recordings can hold a file that is not audio (a truncated download, a text
file with an audio name). Two guards make it cost only its own utterance:

- :func:`read_headers`: ``soundfile.info`` of every file, in a thread pool with a progress
  bar, before any manifest is written. A file whose header cannot be read is returned with the
  reason, for the preparation to leave out and list. libsndfile releases the GIL while it reads,
  so threads overlap the file opens where they wait on storage (from a cold disk the opens
  dominate; from the page cache the threads gain nothing).
- :func:`guarded_read`: a read at training time that fails returns an :class:`Unreadable`
  marker instead of raising (one log line naming the file), and :class:`SkippingCollate` drops
  the examples holding one before the batch is built, counting them. A header can pass and the
  decoding still fail (a file cut short after its header); the client then loses that
  utterance, not its round.

A batch whose every example was dropped is :data:`EMPTY_BATCH`, which the client's training
loop skips.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import soundfile as sf
from tqdm import tqdm

__all__ = [
    "EMPTY_BATCH",
    "PRIVACY_NOTE",
    "SkippingCollate",
    "Unreadable",
    "guarded_read",
    "read_headers",
]

logger = logging.getLogger(__name__)

#: What a left-out utterance means for a private run's guarantee (results.json beside the list).
PRIVACY_NOTE = (
    "An unreadable utterance is left out of its owner's data, before training or when a batch "
    "is built: it only shrinks that data. The unit of privacy is unchanged (a client's whole "
    "partition in a federated run, a record in DP-SGD): the clip still bounds every update and "
    "the accountant counts the same draws, so epsilon stands as reported. The list of "
    "left-out files is an operator diagnostic released without noise, outside the guarantee."
)


@dataclass(frozen=True)
class Unreadable:
    """What an audio pipeline returns for a file it could not read: the file and why."""

    path: str
    reason: str


class _EmptyBatch:
    """The batch of :class:`SkippingCollate` when every example was unreadable."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "EMPTY_BATCH"

    def __reduce__(self) -> str:
        return "EMPTY_BATCH"  # one object per process, also after pickling


#: A batch with no readable example: the training loop skips it.
EMPTY_BATCH = _EmptyBatch()


def _header(path: str) -> tuple[str, float | None, str | None]:
    """``(path, duration, None)``, or ``(path, None, reason)`` when the header is unreadable."""
    try:
        info = sf.info(path)
    except Exception as err:  # libsndfile raises LibsndfileError / RuntimeError / OSError
        return path, None, f"{type(err).__name__}: {err}"
    if not info.frames > 0 or not info.samplerate > 0:
        return path, None, "no audio frames"
    return path, info.frames / info.samplerate, None


def read_headers(
    paths: Iterable[str], *, workers: int | None = None, progress: bool = True, desc: str = "audio"
) -> tuple[dict[str, float], dict[str, str]]:
    """Read every file's header (``soundfile.info``) in a thread pool.

    Arguments
    ---------
    paths : iterable of str
        The audio files.
    workers : int, optional
        Threads; default ``min(32, 4 * os.cpu_count())`` (the opens wait on the disk, not the
        CPU).
    progress : bool
        Show a tqdm bar.
    desc : str
        The bar's label.

    Returns
    -------
    durations : dict
        ``{path: frames / samplerate}`` of the readable files.
    unreadable : dict
        ``{path: reason}`` of the others (a header libsndfile cannot parse, no frames); each is
        also logged once.

    Example
    -------
    >>> import tempfile, os
    >>> bad = os.path.join(tempfile.mkdtemp(), "x.flac")
    >>> _ = open(bad, "w").write("not audio")
    >>> durations, unreadable = read_headers([bad], progress=False)
    >>> durations, list(unreadable) == [bad]
    ({}, True)
    """
    paths = list(paths)
    workers = workers or min(32, 4 * (os.cpu_count() or 1))
    durations: dict[str, float] = {}
    unreadable: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(paths) or 1))) as pool:
        results = pool.map(_header, paths, chunksize=64)
        for path, duration, reason in tqdm(
            results, total=len(paths), desc=desc, disable=not progress or not paths
        ):
            if reason is None:
                durations[path] = duration
            else:
                logger.warning("Unreadable audio (skipped): %s (%s)", path, reason)
                unreadable[path] = reason
    return durations, unreadable


def guarded_read(read: Callable[..., Any], path: str, *args: Any, **kwargs: Any) -> Any:
    """``read(*args, **kwargs)``, or an :class:`Unreadable` for ``path`` when it raises.

    ``read`` is e.g. ``speechbrain.dataio.dataio.read_audio`` and ``args`` its argument (a
    path or a ``{"file", "start", "stop"}`` dict). One warning names the file and the error.

    Example
    -------
    >>> def fails(p):
    ...     raise RuntimeError("not audio")
    >>> guarded_read(fails, "a.flac", "a.flac")
    Unreadable(path='a.flac', reason='RuntimeError: not audio')
    """
    try:
        return read(*args, **kwargs)
    except Exception as err:  # whatever the decoder raises: the file is the fault, not the run
        reason = f"{type(err).__name__}: {err}"
        logger.warning("Unreadable audio (utterance skipped): %s (%s)", path, reason)
        return Unreadable(str(path), reason)


def _unreadable_in(example: Any) -> Unreadable | None:
    """The first :class:`Unreadable` value of a dict example, else ``None``."""
    if type(example) is dict:
        for value in example.values():
            if type(value) is Unreadable:
                return value
    return None


class SkippingCollate:
    """A collate function that drops the examples holding an :class:`Unreadable` value.

    ``collate(examples)`` with those examples left out; :data:`EMPTY_BATCH` when none is left.
    The dropped files are kept in :attr:`skipped` (``{path: reason}``, across calls until
    :meth:`reset`), so a client reports how many of its utterances it could not read. A batch
    of a ``trusted`` type (e.g. :class:`speechbrain_fl.fl.clientapp.collation.TensorRows`, whose dataset
    guarantees tensor values) goes to ``collate`` unchecked.
    Picklable when ``collate`` is (a Ray actor or a SuperNode process builds its own).

    Example
    -------
    >>> collate = SkippingCollate(list)
    >>> collate([{"x": 1}, {"x": Unreadable("b.wav", "bad")}])
    [{'x': 1}]
    >>> collate.skipped, collate([{"x": Unreadable("b.wav", "bad")}])
    ({'b.wav': 'bad'}, EMPTY_BATCH)
    """

    def __init__(self, collate: Callable[[list[Any]], Any], *, trusted: tuple = ()) -> None:
        self.collate = collate
        self.trusted = trusted  # batch types whose examples are known to hold only tensors
        self.skipped: dict[str, str] = {}

    def reset(self) -> None:
        """Forget the files dropped so far (a client calls it at the start of a round)."""
        self.skipped = {}

    def __call__(self, examples: list[Any]) -> Any:
        if type(examples) in self.trusted:
            return self.collate(examples)
        kept = None
        for i, example in enumerate(examples):
            bad = _unreadable_in(example)
            if bad is not None:
                self.skipped[bad.path] = bad.reason
                if kept is None:
                    kept = list(examples[:i])
            elif kept is not None:
                kept.append(example)
        if kept is None:
            return self.collate(examples)  # the same list object (e.g. a TensorRows batch)
        if not kept:
            return EMPTY_BATCH
        return self.collate(kept)

"""An exact, memory-bounded cache of per-utterance features (e.g. Whisper's log-mel).

Whisper's feature extractor (``transformers.WhisperFeatureExtractor``: a NumPy STFT and mel
filterbank of the audio zero-padded to the encoder's 30 s window) is a large share of an MLS
client step on CPU, and a client computes the same utterance's features again every local epoch and every round it
is sampled. :class:`FeatureCache` wraps the extractor's call for a batch of waveforms and
computes only the rows it has not seen.

Exactness: the key of a waveform is its dtype, length and a BLAKE2b digest of its bytes, so a
row is reused only for the identical input (an id could be reused for other audio; a digest
collision is out of reach), and the extractor treats each waveform of a batch independently
(padding to ``max_length`` and truncation are per waveform; tested equal, bit for bit, to the
batched call on Whisper's extractor). The stored rows are private copies; the returned batch
is a new tensor, so a caller writing into it changes nothing in the cache.

Memory: at most ``max_bytes`` of feature rows are kept (least recently used evicted first;
one Whisper row of 80 x 3000 float32 is 0.96 MB, so 1 GiB holds ~1,100 utterances). A node
whose utterances fit in the bound computes each once; on a real corpus it keeps those it
revisited last (the second local epoch, a later round) and computes the rest as before.
``SpeechLLM.use_feature_cache`` (``speechbrain_fl/models/speech_llm.py``) serves
``extract_features`` from it; the MLS recipe turns it on with ``feature_cache_mb``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["FeatureCache"]


def _key(audio: np.ndarray) -> tuple[str, int, str]:
    array = np.ascontiguousarray(audio)
    digest = hashlib.blake2b(array.view(np.uint8), digest_size=16).hexdigest()
    return (array.dtype.str, int(array.size), digest)


class FeatureCache:
    """Per-waveform rows of ``extract(list_of_waveforms) -> Tensor[B, ...]``, at most
    ``max_bytes`` of them kept.

    Arguments
    ---------
    extract : callable
        ``extract(list of 1-D arrays) -> torch.Tensor`` of shape ``(B, ...)``, each row a
        function of its own waveform only (e.g. ``lambda a: fe(a, sampling_rate=16000,
        return_tensors="pt", padding="max_length", truncation=True).input_features``).
    max_bytes : int
        Bound on the stored rows' bytes (> 0).

    Example
    -------
    >>> calls = []
    >>> def extract(audio):
    ...     calls.append(len(audio))
    ...     return torch.stack([torch.from_numpy(a * 2) for a in audio])
    >>> cache = FeatureCache(extract, max_bytes=1 << 20)
    >>> a, b = np.ones(4, dtype=np.float32), np.zeros(4, dtype=np.float32)
    >>> cache([a, b]).tolist(), cache([b, a])[0].tolist(), calls, cache.hits
    ([[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]], [0.0, 0.0, 0.0, 0.0], [2], 2)
    """

    def __init__(
        self, extract: Callable[[list[np.ndarray]], torch.Tensor], *, max_bytes: int
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be an integer > 0, got {max_bytes!r}")
        self.extract = extract
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._rows: OrderedDict[tuple[str, int, str], torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def __call__(self, audio: Sequence[np.ndarray]) -> torch.Tensor:
        """The features of ``audio``, as ``extract(list(audio))`` returns them."""
        keys = [_key(a) for a in audio]
        missing = [i for i, k in enumerate(keys) if k not in self._rows]
        fresh: dict[tuple[str, int, str], torch.Tensor] = {}
        if missing:
            # one call for the rows not cached (a duplicate in the batch is computed once)
            todo = list(dict.fromkeys(keys[i] for i in missing))
            first = {k: next(i for i in missing if keys[i] == k) for k in todo}
            rows = self.extract([audio[first[k]] for k in todo])
            if rows.shape[0] != len(todo):
                raise ValueError(f"extract returned {rows.shape[0]} rows for {len(todo)} waveforms")
            fresh = {k: rows[j].clone() for j, k in enumerate(todo)}
        self.misses += len(fresh)
        self.hits += len(keys) - len(fresh)
        out = torch.stack([fresh[k] if k in fresh else self._rows[k] for k in keys])
        for k in keys:  # most recently used last
            if k in self._rows:
                self._rows.move_to_end(k)
        for k, row in fresh.items():
            self._store(k, row)
        return out

    def _store(self, key: tuple[str, int, str], row: torch.Tensor) -> None:
        size = row.element_size() * row.nelement()
        if size > self.max_bytes:
            return  # a row larger than the bound is computed every time, never kept
        while self.bytes + size > self.max_bytes and self._rows:
            _, old = self._rows.popitem(last=False)
            self.bytes -= old.element_size() * old.nelement()
        self._rows[key] = row
        self.bytes += size

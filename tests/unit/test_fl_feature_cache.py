"""The per-utterance feature cache is exact (Whisper's extractor, bit for bit) and bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speechbrain_fl.utils.feature_cache import FeatureCache


def _whisper():
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor()  # the default config (80 mels, 30 s window): no download

    def extract(audio):
        return fe(
            audio, sampling_rate=fe.sampling_rate, return_tensors="pt",
            padding="max_length", truncation=True,
        ).input_features  # fmt: skip

    return extract


def test_cached_whisper_features_equal_the_batched_call():
    extract = _whisper()
    rng = np.random.default_rng(0)
    utts = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (8000, 12000, 3000)]
    cache = FeatureCache(extract, max_bytes=64 << 20)
    first = cache([utts[0], utts[1]])
    assert torch.equal(first, extract([utts[0], utts[1]]))
    again = cache([utts[2], utts[1], utts[0]])  # two cached rows, one new, another order
    assert torch.equal(again, extract([utts[2], utts[1], utts[0]]))
    assert (cache.hits, cache.misses, len(cache)) == (2, 3, 3)
    again[0].fill_(7.0)  # the returned batch is the caller's
    assert torch.equal(cache([utts[2]]), extract([utts[2]]))


def test_same_length_other_audio_is_not_a_hit():
    calls = []

    def extract(audio):
        calls.append(len(audio))
        return torch.stack([torch.from_numpy(a.copy()) for a in audio])

    cache = FeatureCache(extract, max_bytes=1 << 20)
    a = np.zeros(16, dtype=np.float32)
    b = a.copy()
    b[3] = 1e-7
    cache([a])
    assert cache([b])[0, 3].item() == pytest.approx(1e-7) and cache.misses == 2
    assert cache([a, a]).shape == (2, 16) and calls == [1, 1]  # a duplicate: computed once


def test_memory_bound_evicts_least_recently_used():
    def extract(audio):
        return torch.stack([torch.full((256,), float(a[0])) for a in audio])  # 1 KiB a row

    cache = FeatureCache(extract, max_bytes=3 * 1024)
    utts = [np.full(4, i, dtype=np.float32) for i in range(4)]
    cache(utts[:3])
    cache([utts[0]])  # 0 is now the most recent
    cache([utts[3]])  # evicts 1, the least recently used
    assert cache.bytes <= 3 * 1024 and len(cache) == 3
    misses = cache.misses
    cache([utts[0], utts[2], utts[3]])
    assert cache.misses == misses  # kept
    cache([utts[1]])
    assert cache.misses == misses + 1  # evicted, computed again


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_bytes must be an integer > 0, got 0"):
        FeatureCache(lambda a: torch.zeros(len(a), 1), max_bytes=0)

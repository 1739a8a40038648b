"""SpeechLLM's log-mel cache (``use_feature_cache``): exact, bounded, refused where not exact."""

import pytest
import torch

from speechbrain_fl.models.presets import build_speech_llm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_speech_llm("tiny", cache_dir=str(tmp_path_factory.mktemp("tiny")), seed=0)


def _batch(seed=0, n=3, samples=16000):
    gen = torch.Generator().manual_seed(seed)
    wavs = 0.1 * torch.randn(n, samples, generator=gen)
    lens = torch.tensor([1.0, 0.75, 0.5])[:n]
    return wavs, lens


def test_cached_features_equal_the_extractor_bit_for_bit(tiny):
    wavs, lens = _batch()
    tiny.use_feature_cache(0)
    plain, plain_frames = tiny.extract_features(wavs, lens)
    tiny.use_feature_cache(64 << 20)
    try:
        first, frames = tiny.extract_features(wavs, lens)
        again, _ = tiny.extract_features(wavs.flip(0), lens.flip(0))  # same utterances, reordered
        cache = tiny.feature_cache
        assert torch.equal(first, plain) and torch.equal(frames, plain_frames)
        assert torch.equal(again, plain.flip(0))
        assert (cache.misses, cache.hits) == (3, 3)
        other, _ = tiny.extract_features(*_batch(seed=1))  # new audio: computed, not reused
        assert cache.misses == 6 and not torch.equal(other, plain)
        first.add_(1.0)  # the caller's tensor is its own
        assert torch.equal(tiny.extract_features(wavs, lens)[0], plain)
    finally:
        tiny.use_feature_cache(0)
    assert tiny.feature_cache is None


def test_cache_bound_is_kept(tiny):
    row_bytes = 80 * 2 * tiny.encoder.config.max_source_positions * 4
    tiny.use_feature_cache(2 * row_bytes)
    try:
        tiny.extract_features(*_batch())
        assert len(tiny.feature_cache) == 2 and tiny.feature_cache.bytes <= 2 * row_bytes
    finally:
        tiny.use_feature_cache(0)


def test_dithering_extractor_and_bad_sizes_are_refused(tiny):
    old = getattr(tiny.feature_extractor, "dither", 0.0)
    tiny.feature_extractor.dither = 1e-5
    try:
        with pytest.raises(ValueError, match="dither"):
            tiny.use_feature_cache(1 << 20)
    finally:
        tiny.feature_extractor.dither = old
    with pytest.raises(ValueError, match="feature cache size"):
        tiny.use_feature_cache(-1)
    with pytest.raises(ValueError, match="feature_cache_mb"):
        build_speech_llm("tiny", cache_dir="/nonexistent-unused", feature_cache_mb=1.5)

"""espeak-ng ctypes binding: real synthesis, voices, errors, thread safety."""

import threading

import numpy as np
import pytest

from speechbrain_fl.data.espeak import (
    SAMPLE_RATE,
    Voice,
    list_variants,
    native_sample_rate,
    synthesize,
    synthesize_phonemes,
    variant_info,
)
from speechbrain_fl.data.voices import PROSODY_PRESETS, apply_prosody, make_speakers


def test_synthesize_float32_16k_speech():
    wav = synthesize("the old man sees the red house", Voice(language="en", variant="m2"))
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert 1.0 < len(wav) / SAMPLE_RATE < 4.0
    assert 0.05 < np.abs(wav).max() <= 1.0
    assert native_sample_rate() == 22050


def test_deterministic_and_voice_dependent():
    text = "zwanzig kleine katzen"
    a = synthesize(text, Voice(language="de", variant="f3", pitch=60))
    b = synthesize(text, Voice(language="de", variant="f3", pitch=60))
    c = synthesize(text, Voice(language="de", variant="m3", pitch=30))
    np.testing.assert_array_equal(a, b)
    assert len(a) != len(c) or not np.allclose(a, c)


def test_rate_changes_duration():
    text = "un deux trois quatre cinq six sept"
    slow = synthesize(text, Voice(language="fr", rate=100))
    fast = synthesize(text, Voice(language="fr", rate=300))
    assert len(slow) > 1.5 * len(fast)


def test_all_mls_languages_speak():
    for code in ("en", "de", "nl", "fr", "es", "it", "pt", "pl"):
        assert len(synthesize("dziesięć 10", Voice(language=code))) > 1000


def test_bad_input_errors():
    with pytest.raises(ValueError, match="no voice 'xx'"):
        synthesize("hello", Voice(language="xx"))
    with pytest.raises(ValueError, match="non-empty text"):
        synthesize("  ", Voice(language="en"))
    with pytest.raises(ValueError, match="rate=20"):
        Voice(language="en", rate=20)
    with pytest.raises(KeyError, match="nope"):
        variant_info("nope")


def test_phoneme_events_leave_the_audio_unchanged_and_time_the_phonemes():
    voice = Voice(language="en", variant="m2", rate=150)
    wav, phonemes = synthesize_phonemes("stop the red car", voice, seed=3)
    np.testing.assert_array_equal(wav, synthesize("stop the red car", voice, seed=3))
    names = [name.lstrip("',%=") for name, _ in phonemes]
    assert names[:3] == ["s", "t", "0"] and "r" in names and "d" in names
    starts = [start for _, start in phonemes]
    assert starts == sorted(starts) and 0.0 <= starts[0] and starts[-1] < len(wav) / SAMPLE_RATE
    with pytest.raises(ValueError, match="non-empty text"):
        synthesize_phonemes(" ", voice)


def test_variants_by_gender():
    female, male = set(list_variants("female")), set(list_variants("male"))
    assert {"f1", "f3"} <= female and {"m1", "m2"} <= male and not female & male
    assert variant_info("f3").gender == "female"


def test_thread_safe_matches_sequential():
    texts = [f"number {i} is here" for i in range(8)]
    voice = Voice(language="en", variant="f2")
    expected = [synthesize(t, voice) for t in texts]
    results = [None] * len(texts)

    def work(i):
        results[i] = synthesize(texts[i], voice)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_speakers_deterministic_distinct_gendered():
    a, b = make_speakers(12, seed=3), make_speakers(12, seed=3)
    assert a == b and make_speakers(12, seed=4) != a
    assert len({(s.variant, s.pitch, s.rate) for s in a}) == 12
    assert {s.gender for s in a[::2]} == {"female"} and {s.gender for s in a[1::2]} == {"male"}
    for s in a:
        assert s.variant in list_variants(s.gender)
    assert make_speakers(3, seed=3, offset=9) == a[9:]
    assert {s.gender for s in make_speakers(5, seed=0, gender="male")} == {"male"}


def test_speakers_restricted_variants_and_rates():
    allowed = ("f1", "f2", "m1", "m2")
    spk = make_speakers(20, seed=1, variants=allowed, rate=(220, 260))
    assert {s.variant for s in spk} == set(allowed)
    assert all(220 <= s.rate <= 260 for s in spk)
    assert make_speakers(12, seed=3, variants=None) == make_speakers(12, seed=3)
    with pytest.raises(ValueError, match="installed female voice"):
        make_speakers(2, seed=0, variants=("nope",))
    with pytest.raises(ValueError, match="rate"):
        make_speakers(2, seed=0, rate=(300, 200))


def test_prosody_presets():
    base = make_speakers(1, seed=0)[0].voice("es")
    for name in PROSODY_PRESETS:
        assert len(synthesize("hola", apply_prosody(base, name))) > 0
    assert apply_prosody(base, "slow").rate < base.rate < apply_prosody(base, "fast").rate
    with pytest.raises(KeyError, match="angry"):
        apply_prosody(base, "angry")

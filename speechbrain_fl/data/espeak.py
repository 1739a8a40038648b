"""In-process speech synthesis with espeak-ng, through ctypes.

The ``espeakng-loader`` wheel ships ``libespeak-ng`` and its ``espeak-ng-data`` folder, so no
system package is needed. This module binds the handful of C functions of espeak-ng's
``speak_lib.h`` that synthesis needs (``espeak_Initialize``, ``espeak_SetSynthCallback``,
``espeak_SetVoiceByName``, ``espeak_SetParameter``, ``espeak_Synth``, ``espeak_Synchronize``)
and returns a float32 waveform at 16 kHz (espeak-ng renders at 22,050 Hz; the signal is
resampled with ``torchaudio.transforms.Resample``). :func:`synthesize_phonemes` also returns
when each phoneme starts (espeak-ng's phoneme events), for frame-level phone labels.

Why hand-written: the Python wrappers on PyPI either shell out to the ``espeak-ng`` executable
(one process per utterance, ~100x slower) or only expose phonemisation. The binding runs at
roughly 1000x real time here.

espeak-ng keeps global state (one voice, one callback, filter and noise state carried from
one utterance to the next), so every synthesis call holds a module lock and runs in a freshly
loaded and initialised copy of the library, unloaded afterwards: the samples then depend on
(text, voice, seed) only, whatever was synthesised before, in any process.

Example
-------
>>> from speechbrain_fl.data.espeak import Voice, synthesize
>>> wav = synthesize("hello world", Voice(language="en", variant="f3"))
>>> wav.dtype.name, wav.ndim, 0.3 < len(wav) / 16000 < 3.0
('float32', 1, True)
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

__all__ = [
    "SAMPLE_RATE",
    "Voice",
    "VariantInfo",
    "synthesize",
    "synthesize_phonemes",
    "list_variants",
    "variant_info",
    "native_sample_rate",
    "data_path",
]

SAMPLE_RATE = 16000

# speak_lib.h enums (API revision 12).
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
_INITIALIZE_PHONEME_EVENTS = 0x0001
_EVENT_LIST_TERMINATED = 0
_EVENT_PHONEME = 7
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_PARAM_RATE = 1
_PARAM_PITCH = 3
_PARAM_RANGE = 4
_EE_OK = 0
_RATE_MIN, _RATE_MAX = 80, 450


class _Event(ctypes.Structure):
    """``espeak_EVENT``; the callback reads the phoneme events (type 7: ``id`` holds the
    phoneme's name, ``sample`` the sample it starts at)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


# int SynthCallback(short *wav, int numsamples, espeak_EVENT *events); 0 = continue.
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)


@dataclass(frozen=True)
class Voice:
    """An espeak-ng voice: language, optional variant and prosody.

    Arguments
    ---------
    language : str
        espeak-ng language code, e.g. ``"en"``, ``"de"``, ``"pt"``.
    variant : str or None
        Variant file name in ``espeak-ng-data/voices/!v`` (``"f3"``, ``"m2"``, ``"klatt"``).
    rate : int
        Speaking rate in words per minute (espeak-ng accepts 80 to 450; default 175).
    pitch : int
        Base pitch, 0 to 100 (default 50).
    pitch_range : int
        Pitch range (intonation), 0 to 100 (default 50; 0 is monotone).
    """

    language: str
    variant: str | None = None
    rate: int = 175
    pitch: int = 50
    pitch_range: int = 50

    def __post_init__(self):
        if not self.language or not isinstance(self.language, str):
            raise ValueError(f"Voice.language must be a non-empty string, got {self.language!r}")
        if not _RATE_MIN <= self.rate <= _RATE_MAX:
            raise ValueError(f"Voice.rate={self.rate} outside espeak-ng's [80, 450] wpm")
        for key in ("pitch", "pitch_range"):
            value = getattr(self, key)
            if not 0 <= value <= 100:
                raise ValueError(f"Voice.{key}={value} outside [0, 100]")

    @property
    def name(self) -> str:
        """The name given to ``espeak_SetVoiceByName``, e.g. ``"en+f3"``."""
        return self.language if not self.variant else f"{self.language}+{self.variant}"


@dataclass(frozen=True)
class VariantInfo:
    """A voice variant file: its file name, display name and declared gender (or None)."""

    file: str
    name: str
    gender: str | None


def data_path() -> str:
    """Path of the ``espeak-ng-data`` folder shipped by ``espeakng-loader``."""
    import espeakng_loader

    return espeakng_loader.get_data_path()


class _Engine:
    """One loaded, initialised instance of libespeak-ng (see :func:`_synth_pcm`)."""

    def __init__(self, phoneme_events: bool = False):
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib = self.lib
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synchronize.restype = ctypes.c_int
        lib.espeak_Terminate.restype = ctypes.c_int
        options = _INITIALIZE_DONT_EXIT | (_INITIALIZE_PHONEME_EVENTS if phoneme_events else 0)
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path().encode(), options)
        if rate <= 0:
            raise RuntimeError(
                f"espeak_Initialize failed (returned {rate}) with data path {data_path()!r}"
            )
        self.sample_rate = rate
        lib.espeak_SetSynthCallback(_CALLBACK_REF)
        # espeak-ng draws noise from its own generator (and libc rand()).
        self.set_seed = getattr(lib, "espeak_ng_SetRandSeed", None)
        if self.set_seed is not None:
            self.set_seed.argtypes = [ctypes.c_long]
            self.set_seed.restype = None

    def synth(self, text: str, voice: Voice, seed: int) -> np.ndarray:
        if self.lib.espeak_SetVoiceByName(voice.name.encode()) != _EE_OK:
            raise ValueError(
                f"espeak-ng has no voice {voice.name!r} (language {voice.language!r}, "
                f"variant {voice.variant!r}); see list_variants() and "
                f"{os.path.join(data_path(), 'lang')}"
            )
        for param, value in (
            (_PARAM_RATE, voice.rate),
            (_PARAM_PITCH, voice.pitch),
            (_PARAM_RANGE, voice.pitch_range),
        ):
            self.lib.espeak_SetParameter(param, int(value), 0)
        if self.set_seed is not None:
            self.set_seed(seed)
        data = text.encode("utf-8") + b"\0"
        _CHUNKS.clear()
        _PHONEMES.clear()
        err = self.lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        self.lib.espeak_Synchronize()
        chunks = list(_CHUNKS)
        _CHUNKS.clear()
        if err != _EE_OK:
            raise RuntimeError(f"espeak_Synth failed with code {err} for text {text!r}")
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)

    def close(self):
        self.lib.espeak_Terminate()
        _ctypes.dlclose(self.lib._handle)


def _collect(wav, numsamples, events):
    if wav and numsamples > 0:
        _CHUNKS.append(np.ctypeslib.as_array(wav, shape=(numsamples,)).copy())
    i = 0
    while events and events[i].type != _EVENT_LIST_TERMINATED:
        if events[i].type == _EVENT_PHONEME:
            name = events[i].id.decode("utf-8", "replace")  # a char[8], up to its NUL
            _PHONEMES.append((name, int(events[i].sample)))
        i += 1
    return 0


_CHUNKS: list[np.ndarray] = []
_PHONEMES: list[tuple[str, int]] = []  # (name, start sample): only with phoneme events on
_CALLBACK_REF = _CALLBACK(_collect)  # one C callback for the process; C keeps a raw pointer
_LOCK = threading.Lock()
_NATIVE_RATE: list[int] = []


def _synth_pcm(
    text: str, voice: Voice, seed: int, phonemes: list | None = None
) -> tuple[np.ndarray, int]:
    """Synthesise int16 PCM at the native rate in a freshly loaded libespeak-ng.

    ``phonemes``: a list, initialised with phoneme events on; it receives espeak-ng's
    ``(phoneme, start sample at the native rate)`` pairs.

    espeak-ng keeps state between utterances (filter memories, pitch and flutter phases,
    noise generators), so the same call would give different samples depending on what was
    spoken before. Loading the library, initialising it, speaking and unloading it again
    (``dlclose``) for every utterance makes the output a function of (text, voice, seed) only,
    at a small cost per utterance. If something else in the process holds libespeak-ng open,
    ``dlclose`` cannot unload it and that guarantee is lost (the audio stays valid).
    """
    with _LOCK:
        engine = _Engine(phoneme_events=phonemes is not None)
        try:
            pcm = engine.synth(text, voice, seed)
            if phonemes is not None:
                phonemes.extend(_PHONEMES)
        finally:
            _PHONEMES.clear()
            engine.close()
        if not _NATIVE_RATE:
            _NATIVE_RATE.append(engine.sample_rate)
        return pcm, engine.sample_rate


def native_sample_rate() -> int:
    """The sample rate espeak-ng renders at (22,050 Hz for its formant synthesiser)."""
    if not _NATIVE_RATE:
        _synth_pcm("a", Voice(language="en"), 0)
    return _NATIVE_RATE[0]


@functools.lru_cache(maxsize=8)
def _resampler(orig_freq: int, new_freq: int):
    """A cached ``torchaudio.transforms.Resample`` (its sinc kernel is built once)."""
    import torchaudio

    return torchaudio.transforms.Resample(orig_freq=orig_freq, new_freq=new_freq)


def synthesize(
    text: str, voice: Voice, *, sample_rate: int = SAMPLE_RATE, seed: int = 0
) -> np.ndarray:
    """Synthesise ``text`` with ``voice`` to a mono float32 waveform in [-1, 1].

    Arguments
    ---------
    text : str
        UTF-8 text to speak (plain text, no SSML).
    voice : Voice
        Language, variant and prosody.
    sample_rate : int
        Output sample rate; the 22,050 Hz native output is resampled with
        ``torchaudio.transforms.Resample`` (windowed-sinc interpolation, kernel cached).
    seed : int
        Seed of espeak-ng's noise generator (``espeak_ng_SetRandSeed``): the same text, voice
        and seed give the same samples.

    Returns
    -------
    numpy.ndarray
        float32 samples, shape ``(num_samples,)``.

    Example
    -------
    >>> wav = synthesize("eins zwei drei", Voice(language="de", variant="m2", rate=160))
    >>> bool(abs(wav).max() > 0.01)
    True
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"synthesize() needs non-empty text, got {text!r}")
    pcm, native_rate = _synth_pcm(text, voice, int(seed))
    return _to_float(pcm, native_rate, sample_rate)


def synthesize_phonemes(
    text: str, voice: Voice, *, sample_rate: int = SAMPLE_RATE, seed: int = 0
) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """:func:`synthesize` with espeak-ng's phoneme events: the waveform and the phonemes' starts.

    espeak-ng is initialised with ``espeakINITIALIZE_PHONEME_EVENTS``; each phoneme event
    gives the phoneme's name (its ``id`` field, with espeak-ng's stress and length marks as
    written, e.g. ``"'a"``) and the native-rate sample it starts at, returned in seconds
    (``sample / native_rate``). Phonemes end where the next starts. The waveform is the one
    :func:`synthesize` returns for the same arguments.

    Returns
    -------
    tuple
        ``(wav, phonemes)``: float32 samples and ``[(name, start_seconds), ...]`` in order.

    Example
    -------
    >>> wav, phonemes = synthesize_phonemes("hello", Voice(language="en"))
    >>> [name.lstrip("'") for name, _ in phonemes][:4], phonemes[0][1] < phonemes[-1][1]
    (['h', '@', 'l', 'oU'], True)
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"synthesize_phonemes() needs non-empty text, got {text!r}")
    events: list[tuple[str, int]] = []
    pcm, native_rate = _synth_pcm(text, voice, int(seed), phonemes=events)
    phonemes = [(name, sample / native_rate) for name, sample in events if name]
    return _to_float(pcm, native_rate, sample_rate), phonemes


def _to_float(pcm: np.ndarray, native_rate: int, sample_rate: int) -> np.ndarray:
    """int16 PCM at ``native_rate`` to float32 in [-1, 1] at ``sample_rate``."""
    pcm = pcm.astype(np.float32) / 32768.0
    if sample_rate == native_rate or pcm.size == 0:
        return pcm
    import torch

    with torch.inference_mode():
        out = _resampler(native_rate, sample_rate)(torch.from_numpy(pcm))
    return out.numpy().astype(np.float32, copy=False)


@functools.lru_cache(maxsize=1)
def _variants() -> tuple[VariantInfo, ...]:
    folder = os.path.join(data_path(), "voices", "!v")
    infos = []
    for file in sorted(os.listdir(folder)):
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            continue
        name, gender = file, None
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 2 and fields[0] == "name":
                    name = " ".join(fields[1:])
                elif len(fields) >= 2 and fields[0] == "gender":
                    gender = fields[1].lower() if fields[1].lower() in ("female", "male") else None
        infos.append(VariantInfo(file=file, name=name, gender=gender))
    return tuple(infos)


def list_variants(gender: str | None = None) -> list[str]:
    """Variant file names available in ``espeak-ng-data/voices/!v``.

    Arguments
    ---------
    gender : str or None
        ``"female"`` or ``"male"`` keeps only variants declaring that gender; None keeps all.

    Returns
    -------
    list of str
        Sorted variant file names, e.g. ``["f1", ..., "m1", ...]``.

    Example
    -------
    >>> "f3" in list_variants("female") and "m2" in list_variants("male")
    True
    """
    if gender not in (None, "female", "male"):
        raise ValueError(f"gender must be 'female', 'male' or None, got {gender!r}")
    return [v.file for v in _variants() if gender is None or v.gender == gender]


def variant_info(variant: str) -> VariantInfo:
    """The parsed header of one variant file (raises ``KeyError`` naming it if absent)."""
    for info in _variants():
        if info.file == variant:
            return info
    raise KeyError(
        f"no espeak-ng voice variant {variant!r} in {os.path.join(data_path(), 'voices', '!v')}"
    )

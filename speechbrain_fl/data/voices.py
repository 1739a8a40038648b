"""Synthetic speakers: espeak-ng voice variant x pitch x rate x intonation range.

A :class:`SpeakerVoice` is language-independent (MLS speakers read one language, the SUPERB
speaker tasks need the same person across utterances); :meth:`SpeakerVoice.voice` binds it to
a language. Speakers carry a gender class taken from the variant file's ``gender`` line, so
the Private-Gender recipe can draw gendered voice classes, and :data:`PROSODY_PRESETS` give
utterance-level prosody (emotion-like) changes on top of a speaker.

The variant pools are the intelligible human-like variants of ``espeak-ng-data/voices/!v``
(robotic, whispered and effect voices are left out); variants absent from the installed data
are dropped at run time.

Example
-------
>>> from speechbrain_fl.data.voices import make_speakers
>>> spk = make_speakers(4, seed=0)
>>> [s.gender for s in spk]
['female', 'male', 'female', 'male']
>>> spk == make_speakers(4, seed=0)
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speechbrain_fl.data.espeak import Voice, list_variants

__all__ = [
    "FEMALE_VARIANTS",
    "MALE_VARIANTS",
    "PROSODY_PRESETS",
    "SpeakerVoice",
    "make_speakers",
    "apply_prosody",
]

FEMALE_VARIANTS = (
    "f1", "f2", "f3", "f4", "f5", "Alicia", "Annie", "anika", "aunty", "belinda", "linda", "steph",
)  # fmt: skip
MALE_VARIANTS = (
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "Denis", "Hugo", "Marco", "antonio",
    "michel", "sandro", "travis", "victor",
)  # fmt: skip

# espeak-ng pitch (0-100) windows per gender class; rates in words per minute.
_PITCH = {"female": (45, 80), "male": (20, 55)}
_RATE = (140, 200)
_RANGE = (30, 75)

#: Utterance-level prosody presets: rate scale, pitch shift and intonation range.
PROSODY_PRESETS: dict[str, dict[str, float]] = {
    "neutral": {"rate_scale": 1.0, "pitch_shift": 0, "pitch_range": 50},
    "slow": {"rate_scale": 0.8, "pitch_shift": -3, "pitch_range": 40},
    "fast": {"rate_scale": 1.25, "pitch_shift": 3, "pitch_range": 55},
    "monotone": {"rate_scale": 0.95, "pitch_shift": -5, "pitch_range": 5},
    "excited": {"rate_scale": 1.2, "pitch_shift": 12, "pitch_range": 95},
    "sad": {"rate_scale": 0.75, "pitch_shift": -10, "pitch_range": 15},
}


@dataclass(frozen=True)
class SpeakerVoice:
    """One synthetic speaker (language-independent).

    Arguments
    ---------
    variant : str
        espeak-ng variant file name (``"f3"``, ``"m2"``...).
    gender : str
        ``"female"`` or ``"male"`` (from the variant's pool).
    pitch, rate, pitch_range : int
        espeak-ng base pitch (0-100), words per minute, intonation range (0-100).
    """

    variant: str
    gender: str
    pitch: int
    rate: int
    pitch_range: int

    def voice(self, language: str) -> Voice:
        """This speaker speaking ``language`` (an espeak-ng code such as ``"fr"``)."""
        return Voice(
            language=language,
            variant=self.variant,
            rate=self.rate,
            pitch=self.pitch,
            pitch_range=self.pitch_range,
        )


def apply_prosody(voice: Voice, preset: str) -> Voice:
    """Return ``voice`` with a prosody preset of :data:`PROSODY_PRESETS` applied.

    Example
    -------
    >>> apply_prosody(Voice(language="en", rate=160, pitch=50), "sad").rate
    120
    """
    if preset not in PROSODY_PRESETS:
        raise KeyError(f"unknown prosody preset {preset!r}; known: {sorted(PROSODY_PRESETS)}")
    p = PROSODY_PRESETS[preset]
    return Voice(
        language=voice.language,
        variant=voice.variant,
        rate=int(np.clip(round(voice.rate * p["rate_scale"]), 80, 450)),
        pitch=int(np.clip(voice.pitch + p["pitch_shift"], 0, 100)),
        pitch_range=int(p["pitch_range"]),
    )


def _pool(gender: str) -> list[str]:
    wanted = FEMALE_VARIANTS if gender == "female" else MALE_VARIANTS
    available = set(list_variants(gender))
    pool = [v for v in wanted if v in available]
    if not pool:
        raise RuntimeError(f"no {gender} espeak-ng voice variants found in the installed data")
    return pool


def make_speakers(
    num_speakers: int,
    *,
    seed: int,
    gender: str | None = None,
    offset: int = 0,
    variants: Sequence[str] | None = None,
    rate: tuple[int, int] = _RATE,
) -> list[SpeakerVoice]:
    """Draw ``num_speakers`` distinct synthetic speakers, deterministically for ``seed``.

    Genders alternate female/male (starting with female at even ``offset + i``) unless
    ``gender`` fixes one class. Each speaker gets a variant (cycled through a shuffled pool so
    variants repeat only when the pool is exhausted), a pitch inside its gender's window, a
    rate and an intonation range; (variant, pitch, rate) triples are never repeated.

    Arguments
    ---------
    num_speakers : int
        How many speakers.
    seed : int
        Random seed: same seed, same speakers.
    gender : str or None
        ``"female"``/``"male"`` for one class only, None to alternate.
    offset : int
        Index of the first speaker (to draw further, disjoint-looking speakers with the same
        seed, e.g. a public split after the federated ones).
    variants : sequence of str or None
        Restrict each gender's pool to these variant names (None: the whole pool), e.g. to
        keep some variants out of a public split (``speechbrain_fl/data/mls_synth.py``).
    rate : (int, int)
        Window of speaking rates in words per minute (inclusive; default 140-200).

    Returns
    -------
    list of SpeakerVoice
    """
    if num_speakers < 0:
        raise ValueError(f"num_speakers must be >= 0, got {num_speakers}")
    if gender not in (None, "female", "male"):
        raise ValueError(f"gender must be 'female', 'male' or None, got {gender!r}")
    if not 80 <= rate[0] <= rate[1] <= 450:
        raise ValueError(f"rate must be a window (low, high) inside [80, 450] wpm, got {rate}")
    rng = np.random.default_rng([int(seed), 7919])
    pools = {}
    for g in ("female", "male"):
        pool = _pool(g)
        if variants is not None:
            pool = [v for v in pool if v in set(variants)]
            if not pool and g in ((gender,) if gender else ("female", "male")):
                raise ValueError(f"none of the variants {list(variants)} is an installed {g} voice")
        pools[g] = list(rng.permutation(pool)) if pool else []
    used: set[tuple[str, int, int]] = set()
    speakers, count = [], {"female": 0, "male": 0}
    # Draw the first `offset` speakers too, so speaker offset+i is the same whatever the offset.
    for i in range(offset + num_speakers):
        g = gender or ("female" if i % 2 == 0 else "male")
        pool = pools[g]
        variant = str(pool[count[g] % len(pool)])
        count[g] += 1
        while True:
            pitch = int(rng.integers(*_PITCH[g], endpoint=True))
            rate_wpm = int(rng.integers(*rate, endpoint=True))
            key = (variant, pitch, rate_wpm)
            if key not in used:
                used.add(key)
                break
        pitch_range = int(rng.integers(*_RANGE, endpoint=True))
        if i >= offset:
            speakers.append(SpeakerVoice(variant, g, pitch, rate_wpm, pitch_range))
    return speakers

"""Value checks of the Private-Gender hparams, run before any work (corpus, features, training).

:func:`check_teacher_hparams` and :func:`check_student_hparams` look at every value the two
scripts use and raise :class:`HparamsError` (a ``ValueError``) for the first bad one, with one
message naming the hparams file, the key and the value (and "command line" when the value
came from an override). Values that would otherwise pass silently are errors here: ``clip: 0``
(every clipped gradient is zero: training to chance at a reported epsilon), a non-integer
``aw_floor`` (it would be truncated), ``noise_multiplier <= 0`` (no noise: not private; negative ones
ended in a torch traceback), ``batch_size: 0``. The one check that needs the data,
``delta <= 1 / |D_priv|``, runs as soon as |D_priv| is known
(``speechbrain_fl.distill.dp_training.check_delta``).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = ["HparamsError", "check_student_hparams", "check_teacher_hparams"]

KNOWN_CLASSES = ("male", "female", "other")
SPLITS = ("train", "dev", "test", "validated", "validated_rest")


class HparamsError(ValueError):
    """A bad hparams value, named with its file and key."""


class _Checker:
    def __init__(self, hparams: Mapping, path, overrides: Mapping | None):
        self.hparams, self.path, self.overrides = hparams, path, overrides or {}

    def fail(self, key: str, requirement: str):
        value = self.hparams.get(key)
        where = " (command line)" if key in self.overrides else ""
        raise HparamsError(f"{self.path}: {key} = {value!r}{where}: {requirement}")

    def one_of(self, key, choices):
        if self.hparams.get(key) not in choices:
            self.fail(key, f"must be one of {list(choices)}")

    def boolean(self, key):
        if not isinstance(self.hparams.get(key), bool):
            self.fail(key, "must be True or False")

    def integer(self, key, *, minimum: int, optional: bool = False):
        value = self.hparams.get(key)
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}" + (" or null" if optional else ""))

    def number(self, key, *, low=None, high=None, low_open=True, high_open=False, optional=False):
        value = self.hparams.get(key)
        if optional and value is None:
            return
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            if high is None:
                span = f"{'>' if low_open else '>='} {low}" if low is not None else ""
            else:
                left, right = "(" if low_open else "[", ")" if high_open else "]"
                span = f"in {left}{low}, {high}{right}"
            optional_text = " or null" if optional else ""
            self.fail(key, f"must be a finite number {span}{optional_text}".replace("  ", " "))


def _common_model(c: _Checker) -> None:
    for key in ("n_mels", "max_frames", "dsaf_crop_frames", "channels", "kernel_size"):
        c.integer(key, minimum=1)
    for key in ("conv_stride", "emb_dim"):
        c.integer(key, minimum=1)
    c.integer("layers", minimum=0)
    c.boolean("dsaf")
    c.number("dsaf_compress_scale", low=0)
    c.integer("epochs", minimum=1)
    c.integer("batch_size", minimum=1)
    c.number("lr", low=0)
    c.integer("seed", minimum=0)
    c.integer("bootstrap_resamples", minimum=1)


def check_teacher_hparams(hparams: Mapping, path, overrides: Mapping | None = None) -> None:
    """Every value ``train_teacher.py`` uses (module docstring); raises :class:`HparamsError`."""
    from gender_data import check_privileged_fields

    from speechbrain_fl.privacy.accounting import ACCOUNTANTS

    c = _Checker(hparams, path, overrides)
    classes = hparams.get("classes")
    if (
        not isinstance(classes, list | tuple)
        or len(classes) < 2
        or len(set(classes)) != len(classes)
        or any(k not in KNOWN_CLASSES for k in classes)
    ):
        c.fail("classes", f"must be two or more distinct classes of {list(KNOWN_CLASSES)}")
    data_folder = hparams.get("data_folder")
    if data_folder is not None and not os.path.isdir(data_folder):
        c.fail("data_folder", "is not a folder (null: the embedded corpus)")
    for key in ("priv_split", "aux_split", "test_split"):
        c.one_of(key, SPLITS)
    c.one_of("disjoint_by", ("recording", "speaker"))
    c.boolean("skip_prep")
    c.integer("max_aux", minimum=1, optional=True)
    c.integer("max_clips_per_speaker", minimum=1, optional=True)
    if data_folder is None:
        speakers = hparams.get("corpus_speakers")
        if not isinstance(speakers, Mapping) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in speakers.values()
        ):
            c.fail("corpus_speakers", "must map splits to speaker counts >= 0")
        c.integer("corpus_clips_per_speaker", minimum=1)
        shares = hparams.get("corpus_class_shares")
        if (
            not isinstance(shares, list | tuple)
            or len(shares) != 3
            or any(not isinstance(s, int | float) or s < 0 for s in shares)
            or abs(sum(shares) - 1) > 1e-6
        ):
            c.fail("corpus_class_shares", "must be 3 non-negative shares summing to 1")
        c.one_of("corpus_release_style", ("legacy", "2024"))
        c.one_of("corpus_audio_format", ("mp3", "wav"))
        c.integer("corpus_seed", minimum=0)
    _common_model(c)
    c.one_of("teacher_modality", ("multimodal", "audio"))
    if hparams["teacher_modality"] == "multimodal":
        try:
            check_privileged_fields(hparams.get("privileged_fields") or [])
        except ValueError as err:
            c.fail("privileged_fields", str(err))
        for key in ("priv_buckets", "priv_dim", "max_tokens"):
            c.integer(key, minimum=1)
        c.number("modality_dropout", low=0, low_open=False, high=1, high_open=True)
    c.boolean("dp")
    if hparams["dp"]:
        if hparams.get("noise_multiplier") is None:
            c.number("target_epsilon", low=0)
        else:
            c.number("noise_multiplier", low=0)  # 0 would add no noise: not private
        c.number("delta", low=0, high=1, high_open=True)
        c.number("clip", low=0)  # 0 clips every gradient to zero: no signal
        c.number("clip_median_factor", low=0, optional=True)
        c.one_of("accountant", ACCOUNTANTS)
        c.one_of("privacy_unit", ("clip", "speaker"))
        c.one_of("speaker_reduction", ("mean", "sum"))
        if hparams["privacy_unit"] == "speaker" and hparams["aw_dp"]:
            if hparams.get("aw_mode") == "batch_adaptive":
                c.fail(
                    "privacy_unit",
                    "speaker-level DP-SGD takes the fixed AW-DP weights only (aw_mode: fixed); "
                    "the batch-adaptive form counts records of a class, and one speaker moves "
                    "several counts",
                )
        c.integer("dp_seed", minimum=0, optional=True)
        c.integer("audit_canaries", minimum=0)
        if hparams["audit_canaries"] == 1:
            c.fail("audit_canaries", "must be 0 (off) or >= 2 (half inserted, half held out)")
        c.number("audit_confidence", low=0, high=1, high_open=True)
    c.boolean("aw_dp")
    if hparams["aw_dp"]:
        c.one_of("aw_source", ("aux_counts", "prior"))
        if hparams["aw_source"] == "prior":
            prior = hparams.get("aw_prior")
            if (
                not isinstance(prior, list | tuple)
                or len(prior) != len(classes)
                or any(isinstance(p, bool) or not isinstance(p, int | float) for p in prior)
                or not all(math.isfinite(p) and p > 0 for p in prior)
            ):
                c.fail("aw_prior", f"must be {len(classes)} positive shares, one per class")
        c.number("aw_gamma", low=0, low_open=False)
        c.one_of("aw_mode", ("fixed", "batch_adaptive"))
        c.integer("aw_floor", minimum=1, optional=True)
        if hparams["aw_mode"] == "batch_adaptive" and hparams["dp"] and hparams["audit_canaries"]:
            c.fail(
                "audit_canaries",
                "the audit is not supported with aw_mode: batch_adaptive (a canary has no class "
                "to count); set audit_canaries: 0",
            )
    c.boolean("train_dp_direct")
    c.integer("grad_norm_records", minimum=1)


def check_student_hparams(hparams: Mapping, path, overrides: Mapping | None = None) -> None:
    """Every value ``distill_student.py`` uses; raises :class:`HparamsError`."""
    c = _Checker(hparams, path, overrides)
    if not isinstance(hparams.get("teacher_outputs"), str | os.PathLike):
        c.fail("teacher_outputs", "must be the path of the teacher's aux_logits.npz")
    c.integer("aux_subset", minimum=1, optional=True)
    c.integer("aux_labels", minimum=0, optional=True)
    _common_model(c)
    c.number("temperature", low=0)
    c.number("alpha", low=0, low_open=False, high=1)
    c.one_of("ce_class_weight", ("none", "balanced"))

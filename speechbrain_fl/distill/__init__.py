"""Offline knowledge distillation: the teacher-output store, the KD loss, and the metrics of the
Private-Gender recipe (accuracy, balanced accuracy, macro-F1, per-class recall, MajPred).

DSAF and privileged-modality dropout are model parts
(:mod:`speechbrain_fl.models.gender_classifier`); AW-DP is a DP-SGD helper
(:mod:`speechbrain_fl.privacy.weighted_dpsgd`).
"""

from speechbrain_fl.distill.loss import kd_loss
from speechbrain_fl.distill.store import TeacherOutputs, read_teacher_outputs, write_teacher_outputs

__all__ = ["TeacherOutputs", "kd_loss", "read_teacher_outputs", "write_teacher_outputs"]

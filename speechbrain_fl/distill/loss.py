"""The knowledge-distillation objective (Hinton et al., 2015), as the paper writes it:

    L = alpha * tau^2 * KL(p_t^tau || p_s^tau) + (1 - alpha) * CE(y, p_s),

with ``p^tau = softmax(z / tau)``; ``tau^2`` keeps the soft-target gradients on the scale of
the hard-label ones. ``p_t^tau`` comes from the teacher-output store (tempered on read); the
KL is averaged over the batch (``reduction="batchmean"``, the mathematical KL).

Unlabelled records (label :data:`~speechbrain_fl.distill.labels.IGNORE_LABEL`, a mostly
unlabelled D_aux) take part in the KL term only; the CE term is the (weighted) mean over the
batch's labelled records, and 0 when the batch has none:

    CE = sum_{i labelled} w_{y_i} (-log p_s(y_i | x_i)) / sum_{i labelled} w_{y_i}.

Example
-------
>>> import torch
>>> z = torch.tensor([[2.0, 0.0, -1.0]])
>>> p_t = torch.softmax(z / 2.0, dim=1)
>>> float(kd_loss(z, p_t, torch.tensor([0]), temperature=2.0, alpha=1.0)) < 1e-6
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speechbrain_fl.distill.labels import IGNORE_LABEL

__all__ = ["kd_loss"]


def kd_loss(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    alpha: float,
    class_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * tau^2 * KL(p_t^tau || p_s^tau) + (1 - alpha) * CE`` (module docstring).

    Arguments
    ---------
    student_logits : (B, K) tensor
    teacher_probs : (B, K) tensor
        Teacher probabilities already at temperature ``tau``.
    labels : (B,) long tensor
        D_aux labels (public) for the CE term; ``IGNORE_LABEL`` (-100) for an unlabelled record.
    temperature, alpha : float
        tau > 0, alpha in [0, 1].
    class_weight : (K,) tensor, optional
        Weights of the CE term (``torch.nn.functional.cross_entropy``'s ``weight``).
    """
    if not temperature > 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"need temperature > 0 and alpha in [0, 1], got {temperature}, {alpha}")
    log_ps = F.log_softmax(student_logits / temperature, dim=1)
    kl = F.kl_div(log_ps, teacher_probs, reduction="batchmean")
    labelled = labels != IGNORE_LABEL
    if labelled.any():
        ce = F.cross_entropy(student_logits[labelled], labels[labelled], weight=class_weight)
    else:  # no label in this batch: the KL term alone (keeps the graph, gradient 0 for CE)
        ce = student_logits.sum() * 0.0
    return alpha * temperature**2 * kl + (1.0 - alpha) * ce

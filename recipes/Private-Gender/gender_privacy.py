"""The privacy report of the Private-Gender recipe: every release from D_priv, composed.

A default run releases two DP-SGD models trained on the same D_priv: the teacher (through its
logits on D_aux, and everything computed from them, the student included) and the DP-direct
baseline. Each alone satisfies its own (epsilon, delta); released together they satisfy only
their composition. RDP composes additively (Mironov 2017, Prop. 1): for releases ``r`` with
sampling rate ``q_r``, noise multiplier ``sigma_r`` and ``T_r`` steps,

    RDP_joint(alpha) = sum_r T_r * RDP_SGM(alpha; q_r, sigma_r),

and the joint epsilon is the conversion of that curve at ``delta`` (Balle et al. 2020, Thm 21,
as Opacus converts):

    epsilon = min_alpha [ RDP_joint(alpha) - (log delta + log alpha) / (alpha - 1)
                          + log((alpha - 1) / alpha) ].

:func:`joint_privacy` evaluates this with the accountant itself: one Opacus accountant whose
history holds every release's ``(sigma, q, T)`` (the histories of the releases' own
accountants, concatenated), so the joint figure and each release's figure come from the same
code. With the PRV accountant the same history is composed numerically by Opacus. With the PLD
accountant (the default, the tightest here) dp-accounting composes the privacy loss
distributions of the same events,

    PLD_joint = *_r PLD(SelfComposed(PoissonSampled(q_r, Gaussian(sigma_r)), T_r)),

(``*`` the convolution of privacy-loss distributions, add/remove adjacency, pessimistic grid
:data:`~speechbrain_fl.privacy.accounting.PLD_DISCRETIZATION`), and the RDP figure of the same
history is reported beside it (``epsilon_rdp``).

**Unit of privacy.** DP-SGD here protects one *clip* (one record of D_priv). A speaker with
``k`` clips in D_priv is protected only at group level ``k``: (k epsilon, k e^((k-1) epsilon)
delta) (group privacy, Dwork and Roth 2014, Thm 2.2 for approximate DP), which
:func:`speaker_level` reports. The key ``max_clips_per_speaker`` (``train_teacher.py``) caps
each speaker's clips in D_priv (a random subset, drawn from the recipe seed before training);
``max_clips_per_speaker: 1`` makes the clip-level guarantee a speaker-level one. Default
``null``: no cap, the guarantee is clip-level, which is what Common Voice's many-clip speakers
need to know.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["UNIT_OF_PRIVACY", "history_epsilon", "joint_privacy", "speaker_level"]

UNIT_OF_PRIVACY = (
    "clip: example-level (epsilon, delta)-DP with respect to one record (clip) of D_priv; a "
    "speaker with k clips in D_priv has group-level protection (k epsilon, k e^((k-1) epsilon) "
    "delta); see privacy.speaker_level and the key max_clips_per_speaker"
)


def joint_privacy(releases: Sequence[dict], *, delta: float, accountant: str) -> dict:
    """Joint (epsilon, delta) of several DP-SGD releases from the same D_priv (module docstring).

    Arguments
    ---------
    releases : sequence of dict
        One per release: ``{"name": str, "history": [[sigma, q, steps], ...]}`` (an Opacus
        accountant's history).
    delta : float
        The delta of the joint guarantee.
    accountant : str
        ``"pld"`` (dp-accounting), ``"rdp"`` or ``"prv"`` (Opacus's).

    Returns
    -------
    dict
        ``{"epsilon", "epsilon_rdp", "delta", "accountant", "releases": [{"name", "history"}],
        "note"}``.

    Example
    -------
    >>> one = {"name": "teacher", "history": [[6.72, 0.25, 40]]}
    >>> two = {"name": "DP-direct", "history": [[6.72, 0.25, 40]]}
    >>> a = joint_privacy([one], delta=1e-5, accountant="rdp")["epsilon"]
    >>> b = joint_privacy([one, two], delta=1e-5, accountant="rdp")["epsilon"]
    >>> round(a, 2), round(b, 2)
    (0.99, 1.43)
    """
    if not releases:
        raise ValueError("joint_privacy: no release to compose")
    history = []
    for release in releases:
        for sigma, q, steps in release["history"]:
            history.append((float(sigma), float(q), int(steps)))
    epsilon = history_epsilon(history, delta=delta, accountant=accountant)
    names = [r["name"] for r in releases]
    return {
        "epsilon": epsilon,
        "epsilon_rdp": epsilon
        if accountant == "rdp"
        else history_epsilon(history, delta=delta, accountant="rdp"),
        "delta": delta,
        "accountant": accountant,
        "releases": [
            {"name": r["name"], "history": [list(h) for h in r["history"]]} for r in releases
        ],
        "note": f"joint guarantee of everything released from D_priv ({' + '.join(names)}), "
        f"by composition in the {accountant.upper()} accountant (RDP beside it: epsilon_rdp)",
    }


def history_epsilon(history: Sequence[Sequence], *, delta: float, accountant: str) -> float:
    """Epsilon at ``delta`` of an Opacus-style history ``[(sigma, q, steps), ...]`` composed.

    ``"rdp"`` / ``"prv"``: an Opacus accountant given the history; ``"pld"``: dp-accounting's
    ``PLDAccountant`` (add/remove adjacency, grid ``PLD_DISCRETIZATION``) composing
    ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)`` per entry (module docstring).

    Example
    -------
    >>> pld = history_epsilon([(6.72, 0.25, 40)], delta=1e-5, accountant="pld")
    >>> rdp = history_epsilon([(6.72, 0.25, 40)], delta=1e-5, accountant="rdp")
    >>> pld < rdp, round(rdp, 2)
    (True, 0.99)
    """
    if accountant == "pld":
        import dp_accounting
        from dp_accounting.pld import pld_privacy_accountant

        from speechbrain_fl.privacy.accounting import PLD_DISCRETIZATION

        acc = pld_privacy_accountant.PLDAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            value_discretization_interval=PLD_DISCRETIZATION,
        )
        for sigma, q, steps in history:
            step = dp_accounting.PoissonSampledDpEvent(
                float(q), dp_accounting.GaussianDpEvent(float(sigma))
            )
            acc.compose(dp_accounting.SelfComposedDpEvent(step, int(steps)))
        return float(acc.get_epsilon(delta))
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history]
    return float(acc.get_epsilon(delta=delta))


def speaker_level(*, epsilon: float | None, delta: float | None, max_clips: int | None) -> dict:
    """Speaker-level figures by group privacy: ``(k eps, k e^((k-1) eps) delta)``, ``k`` the cap.

    Example
    -------
    >>> speaker_level(epsilon=1.0, delta=1e-5, max_clips=1)["epsilon"]
    1.0
    >>> round(speaker_level(epsilon=0.5, delta=1e-5, max_clips=2)["delta"], 8)
    3.297e-05
    """
    if epsilon is None:
        return {"max_clips_per_speaker": max_clips, "epsilon": None, "delta": None}
    if max_clips is None:
        return {
            "max_clips_per_speaker": None,
            "epsilon": None,
            "delta": None,
            "note": "no cap on clips per speaker in D_priv: the guarantee is clip-level only "
            "(set max_clips_per_speaker for a speaker-level one)",
        }
    k = int(max_clips)
    return {
        "max_clips_per_speaker": k,
        "epsilon": k * epsilon,
        "delta": k * math.exp((k - 1) * epsilon) * delta,
        "note": "group privacy over the at most max_clips_per_speaker clips of one speaker",
    }

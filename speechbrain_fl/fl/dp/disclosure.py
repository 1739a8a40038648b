"""What a run's epsilon covers, and what it does not (results.json ``privacy``).

The guarantee is client-level (epsilon, delta)-DP of the released global models under add/remove
adjacency: one client (a speaker partition) joins or leaves the population, its whole clipped
update counts, and the joint epsilon of the accountant at (q, sigma, T) bounds what any
observer of the models learns about it. :func:`privacy_disclosure` returns that statement with
everything the run computed from raw client data outside the mechanism (telemetry, profiling,
a raw EMA signal) and every test-only setting that voids it, for the recipe to copy into
results.json and print under its results table (docs/design.md "Privacy invariants" 1 and 4).

A simulated deployment (``noise_cohort_size`` M, ``accounting_population`` N) is labelled
wherever its epsilon shows: results.json's ``privacy.simulated_deployment``
(:func:`simulated_deployment`), the guarantee text (:data:`GUARANTEE_SIMULATED`), a caveat, the
engine's privacy log lines (:func:`simulation_label`) and the first line printed under a results
table (:func:`format_disclosure`).
"""

from __future__ import annotations

from typing import Any

from speechbrain_fl.fl.settings.config import FLConfig, ema_base_of
from speechbrain_fl.fl.settings.secagg import trust_model
from speechbrain_fl.privacy.audit import AUDIT_NOTE

__all__ = [
    "EPSILON_PER_COMPONENT_NOTE",
    "GUARANTEE",
    "GUARANTEE_SIMULATED",
    "SIMULATION_NOTE",
    "OUTSIDE_GUARANTEE",
    "format_audit",
    "format_disclosure",
    "privacy_disclosure",
    "simulated_deployment",
    "simulation_label",
]

GUARANTEE = (
    "client-level (epsilon, delta)-DP of the released global models: one client (a speaker "
    "partition) is added to or removed from the population (add/remove adjacency) and its whole "
    "clipped update counts; the joint epsilon (accountant at q, sigma and the rounds run) is the "
    "guarantee"
)
GUARANTEE_SIMULATED = (
    "the client-level (epsilon, delta)-DP of a SIMULATED deployment, not of this run's clients: "
    "this run trained its cohort with the noise of a cohort of noise_cohort_size clients and "
    "accounted at q = noise_cohort_size / accounting_population (the deployment's rate) for the "
    "rounds run; the real mechanism of a deployment of that size would give this epsilon "
    "(add/remove adjacency, one client's whole clipped update)"
)
SIMULATION_NOTE = (
    "simulation of a large deployment: the noise std on the mean is sigma C / noise_cohort_size "
    "(not sigma C / n of this run's cohort) and epsilon is accounted at q = noise_cohort_size / "
    "population; it shows that deployment's utility at that epsilon and does not bound what "
    "this run's clients leak"
)
EPSILON_PER_COMPONENT_NOTE = (
    "covers that component's sub-vector of the update only (what an observer of that part "
    "alone learns); it is not a guarantee for the client: the joint epsilon is"
)
#: Files holding raw client statistics (means over the cohort, not noised): outside the DP
#: guarantee. They are diagnostics for the operator and must not be published with the model.
OUTSIDE_GUARANTEE = {
    "rounds.csv": (
        "columns joint_norm_mean, clip_rate, mean_clip_ratio, train_loss, norm_<L> and "
        "clip_rate_<L> are means of the clients' raw statistics (cohort_size, num_replied and "
        "num_failed reveal who took part)"
    ),
    "group_norms.csv": "mean_norm and clip_rate are means of the clients' raw group norms",
    "train_log.txt": "the train loss is the mean of the clients' raw losses",
}
ADAPTIVE_NOTE = (
    "clip_quantile: each round's clip follows a quantile of the clients' update norms through "
    "a noisy count of their bits [norm <= C] per pool; the count is released with the update "
    "and covered by epsilon (the update's noise multiplier is raised so that update and count "
    "together spend noise_multiplier, Andrew et al. 2021, Theorem 1); rounds.csv's clip and "
    "unclipped_<pool> columns are those released values"
)
PROFILE_NOTE = (
    "profiling rounds (profile_rounds > 0) ran without noise on the training clients; "
    "profile.json holds their raw norms, and the reported epsilon does not cover them"
)
ALPHA_NOTE = (
    "alpha: auto was derived from raw client norms of the profiling rounds: the choice of "
    "alpha is outside the DP guarantee"
)
RAW_EMA_NOTE = (
    "ema_signal: raw sets the EMA clip budgets from the clients' raw norms, outside the DP "
    "guarantee: the released models depend on non-noised client statistics"
)
NOISY_EMA_NOTE = (
    "the EMA budgets follow the noisy released aggregate (post-processing, inside the guarantee)"
)


def simulated_deployment(config: FLConfig) -> dict[str, Any] | None:
    """``{noise_cohort_size, population, sampling_rate, run_sampling_rate, note}`` of a
    simulated deployment (results.json ``privacy.simulated_deployment``); None without one.

    Example
    -------
    >>> cfg = FLConfig(output_folder="o", noise_multiplier=0.5, clip=1.0, sampling_rate=0.5,
    ...                noise_cohort_size=1000, accounting_population=100000)
    >>> sim = simulated_deployment(cfg)
    >>> sim["noise_cohort_size"], sim["population"], sim["sampling_rate"], sim["run_sampling_rate"]
    (1000, 100000, 0.01, 0.5)
    """
    if not config.simulated_deployment:
        return None
    return {
        "noise_cohort_size": config.noise_cohort_size,
        "population": config.accounting_population,
        "sampling_rate": config.accounting_sampling_rate,
        "run_sampling_rate": config.sampling_rate,
        "note": SIMULATION_NOTE,
    }


def simulation_label(config: FLConfig) -> str:
    """The suffix of a log line showing epsilon: empty, or what deployment it simulates.

    Example
    -------
    >>> simulation_label(FLConfig(output_folder="o"))
    ''
    >>> print(simulation_label(FLConfig(output_folder="o", noise_multiplier=0.5, clip=1.0,
    ...     noise_cohort_size=1000, accounting_population=100000))[:56])
     [SIMULATED deployment: M=1000 clients a round of N=1000
    """
    if not config.simulated_deployment:
        return ""
    return (
        f" [SIMULATED deployment: M={config.noise_cohort_size} clients a round of "
        f"N={config.accounting_population}, q={config.accounting_sampling_rate:.4g}; not this "
        "run's clients' epsilon]"
    )


def privacy_disclosure(
    config: FLConfig, *, profile_rounds: int = 0, alpha_from_profile: bool = False
) -> dict[str, Any]:
    """The labels results.json's ``privacy`` section carries for a run with ``config``.

    Arguments
    ---------
    config : FLConfig
        The run's federated and privacy settings.
    profile_rounds : int
        Non-private profiling rounds run on the training clients before the private run.
    alpha_from_profile : bool
        Whether alpha came from those rounds (``alpha: auto``).

    Returns
    -------
    dict
        ``guarantee`` (``None`` for a non-private run), ``epsilon_covers_everything`` (False
        when anything below voids or bypasses the guarantee), ``caveats`` (list of str),
        ``ema_signal`` (``None`` or ``{"signal", "private", "note"}``),
        ``epsilon_per_component_note``, ``outside_guarantee`` (file -> what in it), with
        ``audit_canaries`` > 0 ``audit_note`` (what the canary audit shows and does not show),
        with ``clip_quantile`` ``adaptive_clipping_note`` (the clip's count is inside epsilon)
        and, for a simulated deployment, ``simulated_deployment``
        (:func:`simulated_deployment`; the guarantee then names it, and a caveat too).

    Example
    -------
    >>> cfg = FLConfig(output_folder="out", noise_multiplier=1.0, clip=1.0, noise_seed=0)
    >>> out = privacy_disclosure(cfg)
    >>> out["epsilon_covers_everything"], out["caveats"][0][:14]
    (False, 'noise_seed=0 i')
    """
    private = config.private
    caveats: list[str] = []
    simulated = simulated_deployment(config) if private else None
    if simulated is not None:
        caveats.append(
            f"SIMULATED deployment (noise_cohort_size={config.noise_cohort_size}, "
            f"accounting_population={config.accounting_population}): the epsilon is that "
            "deployment's, not this run's clients'"
        )
    if private:
        for key, what in (("sampler_seed", "cohorts"), ("noise_seed", "noise")):
            value = getattr(config, key)
            if value is not None:
                caveats.append(
                    f"{key}={value} is fixed (testing only): the {what} are predictable, so the "
                    "run is NOT differentially private"
                )
    ema = None
    if config.clip is not None and ema_base_of(config.method) is not None:
        raw = config.ema_signal == "raw"
        ema = {
            "signal": config.ema_signal,  # "noisy" (the released aggregate) or "raw"
            "private": not raw,
            "note": RAW_EMA_NOTE if raw else NOISY_EMA_NOTE,
        }
        if raw and private:
            caveats.append(RAW_EMA_NOTE)
    outside = dict(OUTSIDE_GUARANTEE)
    if profile_rounds > 0:
        outside["profile.json"] = "raw per-component update norms of the profiling rounds"
        if private:
            caveats.append(PROFILE_NOTE)
    if alpha_from_profile and private:
        caveats.append(ALPHA_NOTE)
    guarantee = GUARANTEE_SIMULATED if simulated is not None else GUARANTEE
    out = {
        "guarantee": guarantee if private else None,
        "epsilon_covers_everything": private and not caveats,
        "caveats": caveats,
        "ema_signal": ema,
        "epsilon_per_component_note": EPSILON_PER_COMPONENT_NOTE,
        "outside_guarantee": outside,
        "trust_model": trust_model(config),
    }
    if private and config.audit_canaries:
        out["audit_note"] = AUDIT_NOTE
    if private and config.clip_quantile is not None:
        out["adaptive_clipping_note"] = ADAPTIVE_NOTE
    if simulated is not None:
        out["simulated_deployment"] = simulated
    return out


def format_audit(audit: dict[str, Any]) -> list[str]:
    """Lines for the canary audit's figures beside the accountant's epsilon.

    Example
    -------
    >>> lines = format_audit({"canaries": 64, "inserted": 30, "held_out": 34, "rounds": 5,
    ...     "epsilon_one_shot": 0.41, "epsilon_lower_bound": 0.0, "confidence": 0.95,
    ...     "accountant_epsilon": 2.5, "accountant": "pld", "exceeds_accountant": False})
    >>> lines[0]
    '  Audit (64 canaries: 30 inserted, 34 held out; 5 rounds; final model only):'
    """
    one_shot = audit.get("epsilon_one_shot")
    lines = [
        f"  Audit ({audit['canaries']} canaries: {audit['inserted']} inserted, "
        f"{audit['held_out']} held out; {audit['rounds']} rounds; final model only):",
        f"    accountant ({audit.get('accountant', '?')}) epsilon {audit['accountant_epsilon']:.3g}"
        f"  |  one-shot estimate {'n/a' if one_shot is None else f'{one_shot:.3g}'}"
        f"  |  lower bound {audit['epsilon_lower_bound']:.3g} at "
        f"{100 * audit['confidence']:.0f}% confidence",
    ]
    if audit.get("exceeds_accountant"):
        lines.append(
            "    WARNING: an audited epsilon exceeds the accountant's: a bug in clipping, noise "
            "or sampling is likely"
        )
    lines.append(
        "    (an estimate and a lower bound for an adversary who sees the final model; they do "
        "not prove the accountant tight or the code correct; canaries are not users)"
    )
    return lines


def format_disclosure(disclosure: dict[str, Any]) -> str:
    """Lines to print under a results table: the guarantee, its caveats, what it leaves out.

    Example
    -------
    >>> cfg = FLConfig(output_folder="out", noise_multiplier=1.0, clip=1.0)
    >>> print(format_disclosure(privacy_disclosure(cfg)).splitlines()[0][:30])
    Privacy: epsilon is client-lev
    """
    if not disclosure.get("guarantee"):
        return "Privacy: not a private run (no noise, no epsilon)."
    lines = []
    simulated = disclosure.get("simulated_deployment")
    if simulated:
        lines.append(
            f"SIMULATED DEPLOYMENT: the epsilon above is that of {simulated['noise_cohort_size']} "
            f"clients a round out of {simulated['population']} (q = "
            f"{simulated['sampling_rate']:.4g}), not of this run's clients "
            f"(q = {simulated['run_sampling_rate']:.4g})."
        )
    lines.append(f"Privacy: epsilon is {disclosure['guarantee']}.")
    if disclosure["caveats"]:
        lines.append("  NOT covered by epsilon:")
        lines += [f"  - {c}" for c in disclosure["caveats"]]
    lines.append(
        "  Outside the guarantee (raw client statistics, keep private): "
        + ", ".join(disclosure["outside_guarantee"])
    )
    lines.append(f"  epsilon_per_component {disclosure['epsilon_per_component_note']}.")
    if disclosure.get("epsilon_rdp") is not None and disclosure.get("accountant") != "rdp":
        lines.append(
            f"  epsilon {disclosure['epsilon']:.4g} ({disclosure.get('accountant')}); "
            f"Opacus RDP gives {disclosure['epsilon_rdp']:.4g} for the same mechanism "
            "(a looser upper bound, printed as a cross-check)."
        )
    if disclosure.get("audit"):
        lines += format_audit(disclosure["audit"])
    elif disclosure.get("audit_note"):
        lines.append("  Audit: canaries were requested but no round was audited.")
    return "\n".join(lines)

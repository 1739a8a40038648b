"""The training loop of the Private-Gender recipe: DP-SGD with Opacus, or non-private.

:func:`train_model` runs one training: DP-SGD (Opacus Poisson sampling, per-sample clipping,
Gaussian noise, optional AW-DP weights, optional gradient-canary audit) when ``dp`` is given,
plain Adam otherwise.

Accounting: ``dp["accountant"]`` is the reported one and the one the sigma search uses
(``pld``, the default: dp-accounting's PLD of ``T`` Poisson-subsampled Gaussian steps; or
Opacus's ``rdp`` / ``prv``). Opacus's engine always keeps its own accountant (the reported one
when Opacus has it, else RDP) and its history ``(sigma, q, T)``; its figure is cross-checked
against :func:`~speechbrain_fl.privacy.accounting.compute_epsilon`, and the RDP figure is
reported beside the default (``epsilon_rdp``).

Audit (``audit`` given, DP only): :class:`~speechbrain_fl.privacy.dpsgd_audit.GradientCanaries`
appends Poisson-drawn canary gradients of norm ``C`` to Opacus's per-sample gradients between
``backward()`` and ``step()``; with fixed AW-DP weights a canary gets the largest weight, 1 (the
label of the rarest class), so its term is at the sensitivity bound ``C``. Not supported with
the batch-adaptive form (a canary has no class to count; refused in ``gender_checks``).

The loop is a plain PyTorch loop rather than ``sb.Brain.fit``: Opacus's
``PrivacyEngine.make_private`` replaces the model, the optimizer and the data loader (Poisson
sampler) at once, and the accountant counts every optimizer step, so the loop Opacus documents
is the one that keeps the accounting exact; SpeechBrain provides the features, the argument
parsing, the experiment folder and the train logger.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch
import torch.nn.functional as F
from gender_model import model_is_multimodal
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

__all__ = ["RAW_LOSS_KEY", "check_delta", "sigma_for", "train_model"]

#: The per-epoch training loss is the mean cross-entropy over D_priv's batches, computed from
#: the raw records before any noise: it leaves the mechanism, so every output that shows it
#: (train_log.txt, the log, results.json) labels it so.
RAW_LOSS_KEY = "loss (raw D_priv statistic, outside the DP guarantee)"


@functools.lru_cache(maxsize=32)
def sigma_for(q: float, target_epsilon: float, steps: int, delta: float, accountant: str) -> float:
    """Noise multiplier for a target epsilon, searched with the reported ``accountant`` (PLD by
    default; Opacus's search for ``rdp`` / ``prv``), once per configuration: the teacher and
    DP-direct share q and the number of steps."""
    from speechbrain_fl.privacy.accounting import noise_multiplier_for_epsilon

    return noise_multiplier_for_epsilon(
        sampling_rate=q,
        target_epsilon=target_epsilon,
        rounds=steps,
        delta=delta,
        accountant=accountant,
    )


def check_delta(delta: float, n_priv: int) -> None:
    """``ValueError`` unless ``0 < delta <= 1 / |D_priv|``."""
    if not 0 < delta <= 1.0 / n_priv:
        raise ValueError(
            f"delta = {delta:g} must lie in (0, 1/|D_priv|] = (0, {1.0 / n_priv:.3g}] "
            f"for |D_priv| = {n_priv}"
        )


def _batch_adaptive(batch_adaptive: dict, class_weights, *, q: float, n: int) -> dict:
    """Coefficients ``a_c = E|B| shares_c w_c / sum_k shares_k w_k`` and the count floor."""
    expected = q * n
    shares = torch.as_tensor(batch_adaptive["shares"], dtype=torch.float64)
    shares = shares / shares.sum()
    mix = shares * class_weights.double()
    floor = batch_adaptive.get("floor")
    if floor is None:
        floor = max(1, math.floor(expected * float(shares.min())))
    return {"coefficients": (expected * mix / mix.sum()).float(), "floor": int(floor)}


def train_model(
    model: torch.nn.Module,
    *,
    feats: torch.Tensor,
    lengths: torch.Tensor,
    tokens: torch.Tensor | None,
    labels: torch.Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    dp: dict | None,
    class_weights: torch.Tensor | None,
    desc: str,
    batch_adaptive: dict | None = None,
    max_steps: int | None = None,
    train_logger=None,
    audit: dict | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Train ``model`` with DP-SGD (``dp`` given) or without; returns ``(model, info)``.

    ``dp`` keys: ``target_epsilon`` or ``noise_multiplier``, ``delta``, ``clip``,
    ``accountant``, ``seed`` (tests only). ``class_weights`` (AW-DP): in DP-SGD, applied to the
    clipped per-sample gradients
    (:class:`~speechbrain_fl.privacy.weighted_dpsgd.WeightedDPOptimizer`); without DP, as
    per-sample loss weights. ``info`` holds the privacy figures and the per-epoch losses.
    ``batch_adaptive`` (``{"shares", "floor"}``, with ``class_weights``): the batch-adaptive
    AW-DP form instead (:class:`~speechbrain_fl.privacy.weighted_dpsgd.BatchAdaptiveDPOptimizer`),
    coefficients ``a_c = E|B| * shares_c w_c / sum_k shares_k w_k`` (each class gets the update
    share the fixed weights give it in expectation; our choice) and count floor ``floor``
    (null: the expected count of the rarest class in a batch, at least 1). ``max_steps``
    (``--debug``) stops early; the accountant then counts only the steps taken. ``audit``
    (``{"canaries": m, "confidence": c, "plot": path or None}``, DP only): the gradient-canary
    audit (module docstring); its figures go to ``info["audit"]``, the cosine histogram to
    ``plot`` (the canaries' scores and split stay in memory).
    """
    from torch.utils.data import DataLoader, TensorDataset

    from speechbrain_fl.privacy.accounting import OPACUS_ACCOUNTANTS, compute_epsilon

    n = labels.numel()
    toks = tokens if tokens is not None else torch.zeros(n, 1, dtype=torch.long)
    loader = DataLoader(
        TensorDataset(feats, lengths, toks, labels), batch_size=batch_size, shuffle=True
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    info: dict = {"dp": dp is not None, "epochs": epochs, "batch_size": batch_size, "lr": lr}
    engine, canaries, canary_label = None, None, None
    if audit is not None and dp is None:
        raise ValueError("audit: the canary audit needs DP-SGD (dp)")
    if dp is not None:
        from opacus.validators import ModuleValidator

        from speechbrain_fl.privacy.weighted_dpsgd import DPSGDPrivacyEngine

        ModuleValidator.validate(model, strict=True)  # no BatchNorm, supported layers only
        check_delta(dp["delta"], n)
        q = 1.0 / len(loader)
        steps = epochs * len(loader)
        sigma = dp.get("noise_multiplier")
        if sigma is None:
            sigma = sigma_for(q, dp["target_epsilon"], steps, dp["delta"], dp["accountant"])
        adaptive = None
        if batch_adaptive is not None and class_weights is not None:
            adaptive = _batch_adaptive(batch_adaptive, class_weights, q=q, n=n)
            info["aw_batch_adaptive"] = {
                "coefficients": adaptive["coefficients"].tolist(),
                "floor": adaptive["floor"],
            }
        opacus_accountant = dp["accountant"] if dp["accountant"] in OPACUS_ACCOUNTANTS else "rdp"
        engine = DPSGDPrivacyEngine(
            accountant=opacus_accountant,
            class_weights=None if adaptive else class_weights,
            batch_adaptive=adaptive,
            seed=dp.get("seed"),
        )
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=float(sigma),
            max_grad_norm=dp["clip"],
            poisson_sampling=True,
        )
        info.update(
            {
                "sampling_rate": q,
                "noise_multiplier": float(sigma),
                "clip": dp["clip"],
                "delta": dp["delta"],
                "accountant": dp["accountant"],
                "opacus_accountant": opacus_accountant,
                "sigma_calibrated_with": None if dp.get("noise_multiplier") else dp["accountant"],
                "planned_steps": steps,
                "aw_dp": class_weights is not None,
            }
        )
        if adaptive:
            info["aw_batch_adaptive"]["sensitivity"] = optimizer.sensitivity
        if audit is not None:
            from speechbrain_fl.privacy.dpsgd_audit import GradientCanaries

            if adaptive:
                raise ValueError("audit: not supported with batch-adaptive AW-DP")
            canaries = GradientCanaries(
                model.named_parameters(), int(audit["canaries"]), clip=dp["clip"], sampling_rate=q
            )
            if class_weights is not None:  # weight 1: the canary's term at the bound C
                canary_label = int(torch.argmax(class_weights))
        logger.info(
            "%s: DP-SGD with q=%.4f, sigma=%.4f, C=%g, %d steps planned%s",
            desc,
            q,
            sigma,
            dp["clip"],
            steps,
            f", batch-adaptive AW-DP {info['aw_batch_adaptive']}" if adaptive else "",
        )
    model.train()
    losses, steps_done, start = [], 0, time.time()
    for epoch in range(1, epochs + 1):
        total, count = 0.0, 0
        for x, lens, tok, y in tqdm(loader, desc=f"{desc} epoch {epoch}/{epochs}", leave=False):
            optimizer.zero_grad(set_to_none=True)
            if y.numel() == 0:  # empty Poisson batch: noise only, still a step of the accountant
                logits = model(x, lens, tok if model_is_multimodal(model) else None)
                loss = logits.sum() * 0.0
            else:
                logits = model(x, lens, tok if model_is_multimodal(model) else None)
                if dp is None and class_weights is not None:
                    loss = (F.cross_entropy(logits, y, reduction="none") * class_weights[y]).mean()
                else:
                    loss = F.cross_entropy(logits, y)
            loss.backward()
            drawn = canaries.insert() if canaries is not None else 0
            if engine is not None and class_weights is not None:
                extra = torch.full((drawn,), canary_label, dtype=y.dtype) if drawn else y[:0]
                optimizer.set_labels(torch.cat([y, extra]))
            optimizer.step()
            total += float(loss.detach()) * y.numel()
            count += y.numel()
            steps_done += 1
            if max_steps is not None and steps_done >= max_steps:
                break
        losses.append(total / max(count, 1))
        stats = {RAW_LOSS_KEY: losses[-1]}
        if engine is not None:  # the same RDP arithmetic, per-step RDP cached (accounting.py)
            stats["epsilon"] = compute_epsilon(
                sampling_rate=info["sampling_rate"],
                noise_multiplier=info["noise_multiplier"],
                rounds=steps_done,
                delta=dp["delta"],
                accountant=dp["accountant"],
            )
        logger.info("%s epoch %d: %s", desc, epoch, stats)
        if train_logger is not None:
            train_logger.log_stats(stats_meta={"model": desc, "epoch": epoch}, train_stats=stats)
        if max_steps is not None and steps_done >= max_steps:
            break
    info.update({"losses": losses, "steps": steps_done, "seconds": round(time.time() - start, 1)})
    if engine is not None:

        def epsilon(accountant):
            return compute_epsilon(
                sampling_rate=info["sampling_rate"],
                noise_multiplier=info["noise_multiplier"],
                rounds=steps_done,
                delta=dp["delta"],
                accountant=accountant,
            )

        # Cross-check the Opacus accountant's history against an independent evaluation.
        opacus_eps = float(engine.get_epsilon(dp["delta"]))
        check = epsilon(opacus_accountant)
        if not math.isclose(check, opacus_eps, rel_tol=1e-6):
            raise RuntimeError(f"accountant mismatch: {opacus_eps} vs {check}")
        info["epsilon"] = (
            opacus_eps if dp["accountant"] == opacus_accountant else epsilon(dp["accountant"])
        )
        info["epsilon_rdp"] = opacus_eps if opacus_accountant == "rdp" else epsilon("rdp")
        if canaries is not None:
            info["audit"] = _audit(canaries, audit, info, delta=dp["delta"])
        info["fixed_seed"] = dp.get("seed")
        # (sigma, q, steps) as the accountant recorded them: the input of the joint report
        info["accountant_history"] = [list(h) for h in engine.accountant.history]
        model = model._module
    else:
        info["epsilon"] = None
    model.eval()
    return model, info


def _audit(canaries, audit: dict, info: dict, *, delta: float) -> dict:
    """Score the canaries, plot the two cosine distributions, return the summary."""
    from speechbrain_fl.privacy.audit import plot_audit_cosines

    summary = canaries.audit(
        delta=delta, accountant_epsilon=info["epsilon"], confidence=audit["confidence"]
    )
    summary["accountant"] = info["accountant"]
    summary["accountant_epsilon_rdp"] = info["epsilon_rdp"]
    summary["expected_canaries_per_step"] = summary["inserted"] * info["sampling_rate"]
    if audit.get("plot") is not None:
        cos, member = canaries.scores()
        plot_audit_cosines(cos, member, summary, audit["plot"], scored="theta_0 - theta_T")
    logger.info(
        "audit (%d gradient canaries, %d inserted, %d insertions over %d steps): one-shot "
        "epsilon %.3f, lower bound %.3f at %.0f%%, accountant %s %.3f (RDP %.3f)",
        summary["canaries"],
        summary["inserted"],
        summary["insertions"],
        summary["steps"],
        summary["epsilon_one_shot"] or 0.0,
        summary["epsilon_lower_bound"],
        100 * summary["confidence"],
        info["accountant"],
        info["epsilon"],
        info["epsilon_rdp"],
    )
    return summary

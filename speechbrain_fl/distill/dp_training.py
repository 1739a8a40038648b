"""Models and training of the DP teacher and its baselines: DP-SGD with Opacus, or non-private.

* :func:`make_model`: a model from the YAML's factory (``model: !name:...GenderClassifier``),
  its initial weights drawn from ``init_seed``.
* :func:`train_model`: one training: DP-SGD (Opacus Poisson sampling, per-sample clipping,
  Gaussian noise, optional AW-DP weights, optional gradient-canary audit) when ``dp`` is given,
  the YAML's optimizer (``opt_class``) without noise otherwise.
* :func:`median_clip`: the clip ``C`` from the median per-sample gradient norm on D_aux.
* :func:`predict_logits`: eval-mode logits in batches; :func:`per_sample_grad_norms`: the DSAF
  diagnostic (Opacus ``GradSampleModule``).

Seeding. The YAML seeds the process once (``seed_everything``). :func:`make_model` reseeds
the global generator with ``init_seed`` on purpose: each model's initialisation (teacher,
DP-direct at ``seed + 1``, student, the two DSAF-diagnostic models) is then a function of the
seed alone, whatever ran before it in the process (cached or computed features, the diagnostic,
``train_dp_direct``, several runs of the studies in one process), and the two diagnostic
models start from the same draw so that their gradient norms are a paired comparison.

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
parsing, the experiment folder, the objects of the YAML and the train logger.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

__all__ = [
    "RAW_LOSS_KEY",
    "check_delta",
    "make_model",
    "median_clip",
    "model_is_multimodal",
    "per_sample_grad_norms",
    "predict_logits",
    "sigma_for",
    "train_model",
]

#: The per-epoch training loss is the mean cross-entropy over D_priv's batches, computed from
#: the raw records before any noise: it leaves the mechanism, so every output that shows it
#: (train_log.txt, the log, results.json) labels it so.
RAW_LOSS_KEY = "loss (raw D_priv statistic, outside the DP guarantee)"


# Models


def make_model(
    factory: Callable[..., torch.nn.Module],
    *,
    num_classes: int,
    privileged: bool,
    init_seed: int | None = None,
    **overrides,
) -> torch.nn.Module:
    """``factory(num_classes=..., privileged=..., **overrides)`` after ``torch.manual_seed(init_seed)``.

    ``factory`` is the YAML's ``model`` (a ``!name:`` partial of
    :class:`~speechbrain_fl.models.gender_classifier.GenderClassifier` holding the sizes), so a
    model is swapped in the YAML; ``overrides`` replace its keywords (the DSAF diagnostic's
    ``dsaf``).
    """
    if init_seed is not None:
        torch.manual_seed(init_seed)
    return factory(num_classes=num_classes, privileged=privileged, **overrides)


def model_is_multimodal(model) -> bool:
    """Whether ``model`` (or the module an Opacus wrapper holds) takes privileged tokens."""
    inner = getattr(model, "_module", model)
    return bool(getattr(inner, "is_multimodal", False))


@torch.no_grad()
def predict_logits(model, feats, lengths, tokens=None, *, batch_size: int = 256) -> torch.Tensor:
    """Logits of ``model`` in eval mode, in batches."""
    model.eval()
    out = []
    for i in range(0, feats.shape[0], batch_size):
        tok = tokens[i : i + batch_size] if tokens is not None else None
        out.append(model(feats[i : i + batch_size], lengths[i : i + batch_size], tok))
    return torch.cat(out)


def per_sample_grad_norms(
    model, feats, lengths, labels, *, tokens=None, batch_size: int = 64
) -> np.ndarray:
    """L2 norms ``||grad_theta CE(f(x_i), y_i)||_2`` of per-sample gradients (Opacus hooks).

    A diagnostic for DSAF, computed on the public D_aux (not on D_priv), in training mode (the
    records are cropped as in training).
    """
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum")
    gsm.train()
    norms = []
    for i in range(0, feats.shape[0], batch_size):
        gsm.zero_grad(set_to_none=True)
        tok = tokens[i : i + batch_size] if tokens is not None else None
        logits = gsm(feats[i : i + batch_size], lengths[i : i + batch_size], tok)
        F.cross_entropy(logits, labels[i : i + batch_size], reduction="sum").backward()
        per = [
            p.grad_sample.reshape(p.grad_sample.shape[0], -1)
            for p in gsm.parameters()
            if p.requires_grad and p.grad_sample is not None
        ]
        norms.append(torch.cat(per, dim=1).norm(dim=1))
    gsm._close()
    return torch.cat(norms).numpy()


# The median clip rule


def median_clip(hparams, model, aux, tokens) -> dict:
    """``C = clip_median_factor * median_i ||g_i||`` of ``model`` at initialisation on D_aux.

    The norms are those of the model about to be trained (its own front-end, DSAF or not), on
    the public D_aux, so the rule costs no privacy and C sits where clipping binds for about
    half the records, the regime where DSAF's lower norm dispersion can matter (with C far
    below every norm, every gradient is clipped with or without DSAF).
    """
    n = min(hparams["grad_norm_records"], aux["labels"].numel())
    norms = per_sample_grad_norms(
        copy.deepcopy(model),  # the model to be trained keeps its untouched initialisation
        aux["feats"][:n],
        aux["lengths"][:n],
        aux["labels"][:n],
        tokens=None if tokens is None else tokens[:n],
    )
    median = float(np.median(norms))
    return {
        "rule": "clip_median_factor * median per-sample gradient norm at init (D_aux)",
        "factor": hparams["clip_median_factor"],
        "median_norm": median,
        "records": int(n),
        "clip": hparams["clip_median_factor"] * median,
    }


# Training


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


@dataclass
class _Private:
    """What :func:`_make_private` sets up for a DP-SGD training (``None`` fields: off)."""

    engine: object = None
    canaries: object = None
    canary_label: int | None = None
    opacus_accountant: str | None = None


def train_model(
    model: torch.nn.Module,
    *,
    feats: torch.Tensor,
    lengths: torch.Tensor,
    tokens: torch.Tensor | None,
    labels: torch.Tensor,
    epochs: int,
    batch_size: int,
    opt_class: Callable,
    dp: dict | None,
    class_weights: torch.Tensor | None,
    desc: str,
    batch_adaptive: dict | None = None,
    max_steps: int | None = None,
    train_logger=None,
    audit: dict | None = None,
    speakers: Sequence[str] | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Train ``model`` with DP-SGD (``dp`` given) or without; returns ``(model, info)``.

    ``opt_class`` (the YAML's ``opt_class``, e.g. ``!name:torch.optim.Adam``) builds the
    optimizer from the parameters; Opacus wraps it for DP-SGD. ``dp`` keys: ``target_epsilon``
    or ``noise_multiplier``, ``delta``, ``clip``, ``accountant``, ``seed`` (tests only).
    ``class_weights`` (AW-DP): in DP-SGD, applied to the clipped per-sample gradients
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
    ``plot`` (the canaries' scores and split stay in memory). ``speakers`` (the speaker id of
    each record, with ``dp``): speaker-level DP-SGD instead of clip-level
    (:func:`~speechbrain_fl.distill.speaker_training.make_speaker_private`).
    """
    from torch.utils.data import DataLoader, TensorDataset

    n = labels.numel()
    toks = tokens if tokens is not None else torch.zeros(n, 1, dtype=torch.long)
    loader = DataLoader(
        TensorDataset(feats, lengths, toks, labels), batch_size=batch_size, shuffle=True
    )
    optimizer = opt_class(model.parameters())
    info: dict = {
        "dp": dp is not None,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": optimizer.defaults.get("lr"),
    }
    if audit is not None and dp is None:
        raise ValueError("audit: the canary audit needs DP-SGD (dp)")
    private = _Private()
    if dp is not None and speakers is not None:
        from speechbrain_fl.distill.speaker_training import make_speaker_private

        model, optimizer, loader, private = make_speaker_private(
            model,
            optimizer,
            loader,
            speakers=speakers,
            dp=dp,
            info=info,
            epochs=epochs,
            class_weights=class_weights,
            batch_adaptive=batch_adaptive,
            audit=audit,
        )
    elif dp is not None:
        model, optimizer, loader, private = _make_private(
            model,
            optimizer,
            loader,
            dp=dp,
            info=info,
            epochs=epochs,
            class_weights=class_weights,
            batch_adaptive=batch_adaptive,
            audit=audit,
            desc=desc,
        )
    model.train()
    start = time.time()
    losses, steps_done = _run_epochs(
        model,
        optimizer,
        loader,
        private=private,
        info=info,
        dp=dp,
        class_weights=class_weights,
        epochs=epochs,
        desc=desc,
        max_steps=max_steps,
        train_logger=train_logger,
    )
    info.update({"losses": losses, "steps": steps_done, "seconds": round(time.time() - start, 1)})
    if private.engine is not None:
        _account(private, info, dp=dp, audit=audit, steps_done=steps_done)
        model = model._module
    else:
        info["epsilon"] = None
    model.eval()
    return model, info


def _make_private(
    model, optimizer, loader, *, dp, info, epochs, class_weights, batch_adaptive, audit, desc
):
    """Opacus's ``make_private`` with sigma for the target epsilon (or the given one), the
    AW-DP optimizer and the canaries; fills ``info`` with the mechanism's settings.

    ``q = 1 / len(loader)`` (Opacus's Poisson rate), ``T = epochs * len(loader)`` planned steps.
    """
    from opacus.validators import ModuleValidator

    from speechbrain_fl.privacy.accounting import OPACUS_ACCOUNTANTS
    from speechbrain_fl.privacy.weighted_dpsgd import DPSGDPrivacyEngine

    n = len(loader.dataset)
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
    private = _Private(opacus_accountant=opacus_accountant)
    private.engine = DPSGDPrivacyEngine(
        accountant=opacus_accountant,
        class_weights=None if adaptive else class_weights,
        batch_adaptive=adaptive,
        seed=dp.get("seed"),
    )
    model, optimizer, loader = private.engine.make_private(
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
        private.canaries = GradientCanaries(
            model.named_parameters(), int(audit["canaries"]), clip=dp["clip"], sampling_rate=q
        )
        if class_weights is not None:  # weight 1: the canary's term at the bound C
            private.canary_label = int(torch.argmax(class_weights))
    logger.info(
        "%s: DP-SGD with q=%.4f, sigma=%.4f, C=%g, %d steps planned%s",
        desc,
        q,
        sigma,
        dp["clip"],
        steps,
        f", batch-adaptive AW-DP {info['aw_batch_adaptive']}" if adaptive else "",
    )
    return model, optimizer, loader, private


def _step_loss(model, x, lens, tok, y, *, weighted: torch.Tensor | None) -> torch.Tensor:
    """Mean CE of a batch (``weighted``: per-sample weights ``w[y]``, the non-DP AW form);
    an empty Poisson batch gives ``0 * sum(logits)``, so the step still adds its noise."""
    logits = model(x, lens, tok if model_is_multimodal(model) else None)
    if y.numel() == 0:
        return logits.sum() * 0.0
    if weighted is not None:
        return (F.cross_entropy(logits, y, reduction="none") * weighted[y]).mean()
    return F.cross_entropy(logits, y)


def _run_epochs(
    model, optimizer, loader, *, private, info, dp, class_weights, epochs, desc, max_steps,
    train_logger,
):  # fmt: skip
    """The training loop; returns the per-epoch mean losses and the optimizer steps taken."""
    from speechbrain_fl.privacy.accounting import compute_epsilon

    weighted = class_weights if dp is None else None
    losses, steps_done = [], 0
    for epoch in range(1, epochs + 1):
        total, count = 0.0, 0
        for x, lens, tok, y in tqdm(loader, desc=f"{desc} epoch {epoch}/{epochs}", leave=False):
            optimizer.zero_grad(set_to_none=True)
            loss = _step_loss(model, x, lens, tok, y, weighted=weighted)
            loss.backward()
            drawn = private.canaries.insert() if private.canaries is not None else 0
            if private.engine is not None and class_weights is not None:
                extra = (
                    torch.full((drawn,), private.canary_label, dtype=y.dtype) if drawn else y[:0]
                )
                optimizer.set_labels(torch.cat([y, extra]))
            optimizer.step()
            total += float(loss.detach()) * y.numel()
            count += y.numel()
            steps_done += 1
            if max_steps is not None and steps_done >= max_steps:
                break
        losses.append(total / max(count, 1))
        stats = {RAW_LOSS_KEY: losses[-1]}
        if private.engine is not None:  # the same arithmetic, per-step RDP cached
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
    return losses, steps_done


def _account(private: _Private, info: dict, *, dp: dict, audit, steps_done: int) -> None:
    """The run's epsilon (reported accountant) and RDP beside it, after cross-checking the
    Opacus accountant's history against an independent evaluation; the audit's figures."""
    from speechbrain_fl.privacy.accounting import compute_epsilon

    def epsilon(accountant):
        return compute_epsilon(
            sampling_rate=info["sampling_rate"],
            noise_multiplier=info["noise_multiplier"],
            rounds=steps_done,
            delta=dp["delta"],
            accountant=accountant,
        )

    opacus_accountant = private.opacus_accountant
    opacus_eps = float(private.engine.get_epsilon(dp["delta"]))
    check = epsilon(opacus_accountant)
    if not math.isclose(check, opacus_eps, rel_tol=1e-6):
        raise RuntimeError(f"accountant mismatch: {opacus_eps} vs {check}")
    info["epsilon"] = (
        opacus_eps if dp["accountant"] == opacus_accountant else epsilon(dp["accountant"])
    )
    info["epsilon_rdp"] = opacus_eps if opacus_accountant == "rdp" else epsilon("rdp")
    if private.canaries is not None:
        info["audit"] = _audit(private.canaries, audit, info, delta=dp["delta"])
    info["fixed_seed"] = dp.get("seed")
    # (sigma, q, steps) as the accountant recorded them: the input of the joint report
    info["accountant_history"] = [list(h) for h in private.engine.accountant.history]


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

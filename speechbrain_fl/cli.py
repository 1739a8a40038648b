"""``speechbrain-fl``: size a private deployment before running it.

Examples
--------
Per-group clip budgets of a layout (table, or ``--json``)::

    speechbrain-fl budgets --layout docs/examples/whisper_tinyllama_layout.json \\
        --method alpha_split --alpha 0.05 --clip 1.0 --noise-multiplier 0.1

A real preset's groups, built at full size on the meta device (configs shipped with the
package, no weights downloaded), grouped as the alpha-split paper's Table I (two groups per
transformer layer: its LoRA A factors, its LoRA B factors; ``--group-by parameter``: one group
per tensor, ``module``: one per adapted projection)::

    speechbrain-fl budgets --preset whisper_tinyllama --method pfl_uniform

(epsilon, delta) of a run, or the sigma needed for a target epsilon::

    speechbrain-fl privacy --sampling-rate 0.3 --noise-multiplier 1.0 --rounds 40 --delta 1e-5
    speechbrain-fl privacy --sampling-rate 0.3 --epsilon 8 --rounds 40 --delta 1e-5

EMA methods have no observed norms here, so they show their base (warm-up) allocation.

The console script lives at the package's top level (``speechbrain_fl.cli:main``), beside the
parts it reads: the privacy core stays free of command-line concerns.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from importlib import metadata
from pathlib import Path

from speechbrain_fl.privacy.accounting import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    compute_epsilon,
    effective_noise_multiplier,
    noise_multiplier_for_epsilon,
)
from speechbrain_fl.privacy.budgets import budget_methods, component_budgets, compute_budgets
from speechbrain_fl.privacy.layout import Layout
from speechbrain_fl.utils.logging import muted

__all__ = ["main", "build_parser"]


def _version() -> str:
    """The installed distribution's version (the package's ``__version__`` when run from a tree
    that is not installed)."""
    try:
        return metadata.version("speechbrain-fl")
    except metadata.PackageNotFoundError:
        from speechbrain_fl import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``speechbrain-fl`` console script."""
    parser = argparse.ArgumentParser(
        prog="speechbrain-fl",
        description="Component-aware DP: clip budgets and (epsilon, delta) accounting.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("budgets", help="per-group clip budgets of a layout or a model preset")
    source = b.add_mutually_exclusive_group(required=True)
    source.add_argument("--layout", help="layout JSON: list of {name, component, numel}")
    source.add_argument(
        "--preset",
        help="a real model preset (whisper_tinyllama, whisper_eurollm, voxtral), built at full "
        "size on the meta device with LoRA rank 8 on the encoder and the LLM",
    )
    b.add_argument(
        "--group-by",
        choices=("layer_factor", "module", "parameter"),
        help="--preset: layer_factor (default; per layer, its LoRA A factors and its B factors: "
        "the paper's Table I), module (per adapted projection) or parameter (per tensor)",
    )
    b.add_argument(
        "--freeze-encoder", action="store_true", help="--preset: no encoder LoRA (frozen)"
    )
    b.add_argument("--method", required=True, choices=budget_methods())
    b.add_argument("--alpha", type=float, help="encoder budget fraction for alpha_split")
    b.add_argument("--clip", type=float, default=1.0, help="total L2 clip C (default 1.0)")
    b.add_argument(
        "--noise-multiplier",
        type=float,
        default=1.0,
        help="sigma, for the per-component sigma_eff (default 1.0: sigma_eff in units of sigma)",
    )
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.set_defaults(subparser=b)

    p = sub.add_parser("privacy", help="epsilon of a run, or sigma for a target epsilon")
    p.add_argument("--sampling-rate", type=float, required=True, help="client sampling rate q")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--noise-multiplier", type=float, help="sigma; prints epsilon")
    g.add_argument("--epsilon", type=float, help="target epsilon; prints the sigma needed")
    p.add_argument("--rounds", type=int, required=True, help="number of FL rounds T")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default=DEFAULT_ACCOUNTANT,
        help=f"accountant of the reported epsilon (default {DEFAULT_ACCOUNTANT}; Opacus's RDP "
        "is printed beside it as a cross-check)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(subparser=p)
    return parser


def _preset_layout(preset: str, *, group_by: str, freeze_encoder: bool) -> Layout:
    """The trainable groups of a real preset built on the meta device (no weights)."""
    from speechbrain_fl.models.preset_configs import check_preset, hub_ids
    from speechbrain_fl.privacy.layout import layout_from_model

    try:
        hub_ids(preset)
    except (KeyError, ValueError) as err:
        raise ValueError(f"--preset: {err}") from None
    variant = "frozen" if freeze_encoder else "unfrozen"
    model = check_preset(preset, return_models=True)[variant]
    return layout_from_model(model, components=model.component_patterns(), group_by=group_by)


def _layout(args, parser) -> Layout:
    """The layout of ``--layout`` (a JSON file) or ``--preset`` (built, grouped by --group-by)."""
    if args.preset is None:
        if args.group_by is not None or args.freeze_encoder:
            parser.error("--group-by and --freeze-encoder apply to --preset only")
        path = Path(args.layout)
        if not path.is_file():
            parser.error(f"--layout: file not found: {path}")
        return Layout.from_json(path)
    args.group_by = args.group_by or "layer_factor"
    return _preset_layout(args.preset, group_by=args.group_by, freeze_encoder=args.freeze_encoder)


def _budgets(args, parser) -> str:
    try:
        layout = _layout(args, parser)
        budgets = compute_budgets(layout, method=args.method, clip=args.clip, alpha=args.alpha)
        comp = component_budgets(layout, budgets)
        if args.noise_multiplier < 0:
            raise ValueError(f"--noise-multiplier must be >= 0, got {args.noise_multiplier}")
    except ValueError as err:
        parser.error(str(err))
    sigma = args.noise_multiplier
    per_group = budgets if isinstance(budgets, dict) else {n: budgets for n in layout.names}
    result = {
        "method": args.method,
        "clip": args.clip,
        "groups": [
            {
                "name": g.name,
                "component": g.component,
                "numel": g.numel,
                "budget": per_group[g.name],
            }
            for g in layout
        ],
        "components": {
            label: {
                "budget": cb,
                "sigma_eff": effective_noise_multiplier(
                    noise_multiplier=sigma, clip=args.clip, budget=cb
                )
                if cb > 0
                else None,
            }
            for label, cb in comp.items()
        },
    }
    flat = not isinstance(budgets, dict)
    lines = [
        f"method {args.method}  clip C={args.clip:g}  sigma={sigma:g}  "
        f"groups {len(layout)}  params {layout.total_numel:,}",
    ]
    if args.preset is not None:
        result["preset"], result["group_by"] = args.preset, args.group_by
        lines.append(
            f"preset {args.preset} ({'encoder frozen' if args.freeze_encoder else 'encoder LoRA'}"
            f", meta device), grouped by {args.group_by}"
        )
    if args.json:
        return json.dumps(result, indent=1)
    lines += [
        "",
        f"{'component':<12}{'groups':>7}{'params':>12}{'budget':>10}{'mean C_l':>10}"
        f"{'sigma_eff':>11}",
    ]
    for label, groups in layout.by_component().items():
        mean_cl = sum(per_group[g.name] for g in groups) / len(groups)
        se = result["components"][label]["sigma_eff"]
        lines.append(
            f"{label:<12}{len(groups):>7}{sum(g.numel for g in groups):>12,}"
            f"{comp[label]:>10.4f}{mean_cl:>10.4f}{(se if se is not None else float('inf')):>11.4f}"
        )
    if flat:
        lines.append("(flat: one clip over the whole update; every component may use all of C)")
    lines += ["", f"{'group':<48}{'component':<12}{'numel':>10}{'budget':>10}"]
    for row in result["groups"]:
        lines.append(
            f"{row['name']:<48}{row['component']:<12}{row['numel']:>10,}{row['budget']:>10.5f}"
        )
    return "\n".join(lines)


def _privacy(args, parser) -> str:
    caught = []
    try:
        # the accountant's warnings are collected and printed once, in the output (not also
        # through its logger on stderr)
        with (
            warnings.catch_warnings(record=True) as caught,
            muted("speechbrain_fl.privacy", level=logging.ERROR),
        ):
            warnings.simplefilter("always")
            if args.epsilon is None:
                eps = compute_epsilon(
                    sampling_rate=args.sampling_rate,
                    noise_multiplier=args.noise_multiplier,
                    rounds=args.rounds,
                    delta=args.delta,
                    accountant=args.accountant,
                )
                sigma = args.noise_multiplier
            else:
                sigma = noise_multiplier_for_epsilon(
                    sampling_rate=args.sampling_rate,
                    target_epsilon=args.epsilon,
                    rounds=args.rounds,
                    delta=args.delta,
                    accountant=args.accountant,
                )
                eps = compute_epsilon(
                    sampling_rate=args.sampling_rate,
                    noise_multiplier=sigma,
                    rounds=args.rounds,
                    delta=args.delta,
                    accountant=args.accountant,
                )
            eps_rdp = compute_epsilon(
                sampling_rate=args.sampling_rate,
                noise_multiplier=sigma,
                rounds=args.rounds,
                delta=args.delta,
                accountant="rdp",
                warn=False,
            )
    except ValueError as err:
        parser.error(str(err))
    notes = sorted({str(w.message) for w in caught})
    result = {
        "epsilon": eps,
        "epsilon_rdp": eps_rdp,
        "delta": args.delta,
        "accountant": args.accountant,
        "sampling_rate": args.sampling_rate,
        "noise_multiplier": sigma,
        "rounds": args.rounds,
    }
    if args.epsilon is not None:
        result["target_epsilon"] = args.epsilon
    if notes:
        result["warnings"] = notes
    if args.json:
        return json.dumps(result, indent=1)
    lines = [
        f"accountant        {args.accountant}",
        f"sampling rate q   {args.sampling_rate:g}",
        f"noise multiplier  {sigma:.6g}" + ("  (for the target epsilon)" if args.epsilon else ""),
        f"rounds T          {args.rounds}",
        f"delta             {args.delta:g}",
        f"epsilon           {eps:.6g}",
    ]
    if args.accountant != "rdp":
        lines.append(f"epsilon (RDP)     {eps_rdp:.6g}  (cross-check: Opacus's RDP accountant)")
    lines += [f"warning: {n}" for n in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``speechbrain-fl`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = _budgets if args.command == "budgets" else _privacy
    sys.stdout.write(run(args, args.subparser) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

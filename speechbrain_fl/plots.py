"""The figures every federated run writes to ``<output_folder>/plots/``.

They reproduce the diagnostic figures of the alpha-split paper from one run's own logs
(``rounds.csv`` and ``group_norms.csv``, formats in ``docs/api.md``, "Run outputs"):

- ``group_norms.png`` (Fig. 2): mean update norm per trainable group, sorted descending, log
  scale, colored by component, with the norm of the Gaussian noise each matrix receives,
  ``sigma * C * sqrt(p_h) / n`` (Eq. 4 over its p_h values; one mark per bar), beside the band
  the paper draws, ``sigma * C / sqrt(n)``.
- ``clipping_dynamics.png`` (Fig. 3): mean joint update norm (left axis) with the clip ``C``,
  client clip rate and mean clip ratio ``r_bar = mean_i min(1, C / ||Delta theta_i||)`` (right
  axis); second panel: mean update norm per component per round.
- ``component_clipping.png`` (Fig. 5): per-component clip rate per round; per-component mean
  norm with its pool budget dashed.
- ``effective_noise.png`` (Fig. 4): ``sigma_eff = sigma / sqrt(f)`` of each alpha-split pool
  (``speechbrain_fl/privacy/budgets.py``: the first pool has the fraction ``f = alpha``, the
  second ``1 - alpha``; Section IV-A4) against alpha, the flat-DP reference ``sigma`` and the
  run's alpha.
- ``metrics_by_round.png``: every metric column (WER, valid_loss, ...) against the round.
- ``epsilon_by_round.png``: the privacy spent so far.

:func:`plot_runs_by_round` draws one metric of many runs on shared axes (the MLS method
table's dev WER of every method, ``recipes/MLS/studies/method_table.py``).

Component labels and their order come from the run's files (the layout's order), never from a
fixed list: each label takes the next tab10 color in that order, which for a speech LLM
(encoder, connector, llm) gives the paper's blue, orange and green. Reading the files is
:mod:`speechbrain_fl.run_outputs`'s job; this module only draws. A figure whose inputs are absent
(a FedAvg run has no budgets, noise or epsilon) is skipped with a log line, never an error.
Figures are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas, without pyplot,
so nothing global (backend, open figures) is touched.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from speechbrain_fl.privacy import (
    Group,
    Layout,
    alpha_split_pools,
    compute_budgets,
    effective_noise_multipliers,
)
from speechbrain_fl.run_outputs import (
    Table,
    component_labels,
    has_values,
    mean_cohort_size,
    metric_columns,
    read_group_norms,
    read_rounds,
    read_table,
    series,
)

logger = logging.getLogger(__name__)

_PALETTE = tuple(f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown",
                                     "pink", "gray", "olive", "cyan"))  # fmt: skip
_POOL_COLORS = ("tab:red", "tab:blue", "tab:green", "tab:purple")


def component_color(label: str, labels: Sequence[str]) -> str:
    """Color of component ``label``: the tab10 color at its position in ``labels`` (layout order).

    Example
    -------
    >>> [component_color(c, ["encoder", "connector", "llm"]) for c in ("encoder", "llm")]
    ['tab:blue', 'tab:green']
    """
    position = list(labels).index(label) if label in labels else len(labels)
    return _PALETTE[position % len(_PALETTE)]


def _save(fig: Figure, path: Path, *, integer_x: bool = True) -> Path:
    FigureCanvasAgg(fig)
    if integer_x:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def noise_floor(
    *,
    noise_multiplier: float,
    clip: float,
    expected_cohort_size: float,
    numel: float | None = None,
) -> float:
    """Noise floor of Fig. 2: the paper's ``sigma C / sqrt(n)``, or one matrix's noise norm.

    The server adds N(0, (sigma C / n)^2 I) to the mean update (Eq. 4), so a matrix of
    ``numel`` = p values receives noise of norm about ``sigma C sqrt(p) / n``: what its mean
    update norm must exceed to survive. Without ``numel`` this returns the band the paper's
    Fig. 2 draws, ``sigma C / sqrt(n)`` (~10x lower for Table I's matrices: sqrt(p) / sqrt(n)).

    Example
    -------
    >>> round(noise_floor(noise_multiplier=0.1, clip=1.0, expected_cohort_size=94), 4)
    0.0103
    >>> round(noise_floor(noise_multiplier=0.1, clip=1.0, expected_cohort_size=94,
    ...                   numel=10_240), 4)
    0.1077
    """
    if expected_cohort_size <= 0:
        raise ValueError(f"expected_cohort_size must be > 0, got {expected_cohort_size}")
    if numel is None:
        return noise_multiplier * clip / math.sqrt(expected_cohort_size)
    return noise_multiplier * clip * math.sqrt(numel) / expected_cohort_size


def effective_noise_curve(
    noise_multiplier: float, alphas: Sequence[float] | np.ndarray
) -> dict[str, np.ndarray]:
    """Effective noise multiplier of each alpha-split pool against alpha (Section IV-A4).

    The pools are those of :func:`speechbrain_fl.privacy.alpha_split_pools`; the budgets come
    from :func:`~speechbrain_fl.privacy.compute_budgets` and ``sigma_eff = sigma * C / C_pool``
    from :func:`~speechbrain_fl.privacy.effective_noise_multipliers` (a layout of one group per
    pool), so this figure repeats neither formula. For the paper's two pools this is
    ``sigma / sqrt(alpha)`` (encoder) and ``sigma / sqrt(1 - alpha)`` (LLM + connector).

    Returns
    -------
    dict of str to numpy.ndarray
        ``"alpha"`` and one curve per pool name.

    Example
    -------
    >>> c = effective_noise_curve(0.1, [0.05])
    >>> {k: round(float(v[0]), 3) for k, v in c.items()}
    {'alpha': 0.05, 'encoder': 0.447, 'llm': 0.103}
    """
    alphas = np.asarray(alphas, dtype=np.float64)
    curve = {"alpha": alphas}
    for i, alpha in enumerate(alphas.tolist()):
        pools = alpha_split_pools(alpha)
        layout = Layout([Group(p.name, p.components[0], 1) for p in pools])
        budgets = compute_budgets(layout, method="alpha_split", clip=1.0, pools=pools)
        sigma_eff = effective_noise_multipliers(
            layout, budgets, clip=1.0, noise_multiplier=noise_multiplier
        )
        for pool in pools:
            curve.setdefault(pool.name, np.empty(alphas.size))[i] = sigma_eff[pool.components[0]]
    return curve


def plot_group_norms(
    group_norms: Table,
    path: Path,
    *,
    floor: float | None = None,
    noise: Mapping[str, float] | None = None,
) -> Path:
    """Fig. 2: mean update norm per group over the rounds, sorted descending, log scale.

    Arguments
    ---------
    group_norms : dict
        Columns of ``group_norms.csv`` (``group``, ``component`` as text).
    path : Path
        The PNG to write.
    floor : float, optional
        The paper's noise floor ``sigma * C / sqrt(n)``, drawn as a band below it.
    noise : dict of str to float, optional
        Each group's noise norm ``sigma * C * sqrt(p_h) / n`` (:func:`noise_floor` with
        ``numel``), drawn as a black mark on its bar.

    Returns
    -------
    Path
    """
    groups, components = group_norms["group"], group_norms["component"]
    norms = group_norms["mean_norm"]
    names, component_of, means = [], {}, []
    for name in dict.fromkeys(groups.tolist()):
        values = norms[(groups == name) & np.isfinite(norms)]
        if values.size:
            names.append(name)
            component_of[name] = str(components[groups == name][0])
            means.append(float(values.mean()))
    order = np.argsort(means)[::-1]
    layout_order = list(dict.fromkeys(component_of.values()))  # colors: the layout's order
    labels = list(dict.fromkeys(component_of[names[i]] for i in order))  # legend: by norm
    fig = Figure(figsize=(max(6.0, min(16.0, 0.12 * len(names) + 4)), 4))
    ax = fig.add_subplot()
    heights = np.maximum(np.array(means)[order], np.finfo(float).tiny)
    colors = [component_color(component_of[names[i]], layout_order) for i in order]
    ax.bar(np.arange(len(order)), heights, color=colors, width=0.85)
    handles = [Patch(color=component_color(lab, layout_order), label=lab) for lab in labels]
    if floor is not None and floor > 0:
        ax.axhspan(min(heights.min(), floor) / 2, floor, color="pink", alpha=0.5, zorder=0)
        handles.append(
            ax.axhline(floor, color="deeppink", lw=1, label=f"paper's floor σC/√n = {floor:.3g}")
        )
    if noise:
        marks = [noise.get(names[i], np.nan) for i in order]
        handles.append(
            ax.scatter(
                np.arange(len(order)), marks, marker="_", s=120, color="black", zorder=3,
                label="noise norm per matrix σC√p/n",
            )
        )  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("trainable group (sorted by mean norm)")
    ax.set_ylabel("mean update norm ‖Δθ_h‖₂")
    ax.set_title("Per-group mean update norm")
    ax.legend(handles=handles, fontsize=8)
    return _save(fig, path)


def plot_clipping_dynamics(rounds: Table, path: Path, *, clip: float | None = None) -> Path:
    """Fig. 3: mean joint norm, clip rate and mean clip ratio per round; component norms below."""
    components = component_labels(rounds, "norm")
    fig = Figure(figsize=(7, 6 if components else 4))
    axes = fig.subplots(2 if components else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    ax.plot(*series(rounds, "joint_norm_mean"), "k--o", ms=3, label="mean joint norm")
    if clip:
        ax.axhline(clip, color="grey", ls=":", label=f"C = {clip:g}")
    ax.set_ylabel("mean joint update norm")
    handles, names = ax.get_legend_handles_labels()
    rates = [
        (c, color, name)
        for c, color, name in (
            ("clip_rate", "tab:red", "clip rate"),
            ("mean_clip_ratio", "tab:purple", "mean clip ratio r̄"),
        )
        if has_values(rounds, c)
    ]
    if rates:
        right = ax.twinx()
        for column, color, name in rates:
            right.plot(*series(rounds, column), "-o", color=color, ms=3, label=name)
        right.set_ylim(-0.02, 1.05)
        right.set_ylabel("fraction")
        more_handles, more_names = right.get_legend_handles_labels()
        handles, names = handles + more_handles, names + more_names
    ax.legend(handles, names, fontsize=8, loc="best")
    ax.set_title("Clipping dynamics")
    if components:
        low = axes[1]
        for label in components:
            low.plot(
                *series(rounds, f"norm_{label}"),
                "-o",
                ms=3,
                color=component_color(label, components),
                label=label,
            )
        low.set_yscale("log")
        low.set_ylabel("mean update norm per component")
        low.legend(fontsize=8)
    axes[-1].set_xlabel("round")
    return _save(fig, path)


def plot_component_clipping(rounds: Table, path: Path) -> Path:
    """Fig. 5: per-component clip rate (top); per-component norm with dashed budget (bottom)."""
    labels = list(
        dict.fromkeys(
            component_labels(rounds, "clip_rate")
            + component_labels(rounds, "norm")
            + component_labels(rounds, "budget")
        )
    )
    fig = Figure(figsize=(7, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for label in labels:
        color = component_color(label, labels)
        if has_values(rounds, f"clip_rate_{label}"):
            top.plot(*series(rounds, f"clip_rate_{label}"), "-o", ms=3, color=color, label=label)
        if has_values(rounds, f"norm_{label}"):
            bottom.plot(*series(rounds, f"norm_{label}"), "-o", ms=3, color=color, label=label)
        if has_values(rounds, f"budget_{label}"):
            bottom.plot(
                *series(rounds, f"budget_{label}"),
                "--",
                color=color,
                label=f"budget {label}",
            )
    top.set_ylim(-0.02, 1.05)
    top.set_ylabel("client clip rate")
    top.set_title("Per-component clipping")
    bottom.set_yscale("log")
    bottom.set_ylabel("mean update norm")
    bottom.set_xlabel("round")
    for ax in (top, bottom):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, path)


def plot_effective_noise(path: Path, *, noise_multiplier: float, alpha: float | None) -> Path:
    """Fig. 4: sigma_eff of each alpha-split pool against alpha, flat reference, run's alpha."""
    curve = effective_noise_curve(noise_multiplier, np.linspace(0.01, 0.99, 197))
    pools = alpha_split_pools(0.5)
    fractions = ("α", "(1−α)")  # the fractions of alpha_split_pools' two pools, in order
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for i, pool in enumerate(pools):
        formula = f"σ/√{fractions[i]}" if i < len(fractions) else "σ/√f"
        ax.plot(
            curve["alpha"],
            curve[pool.name],
            color=_POOL_COLORS[i % len(_POOL_COLORS)],
            label=f"{' + '.join(pool.components)} {formula}",
        )
    ax.axhline(noise_multiplier, color="k", ls="--", label=f"flat DP σ = {noise_multiplier:g}")
    if alpha is not None and 0.0 < alpha < 1.0:
        point = effective_noise_curve(noise_multiplier, [alpha])
        ax.axvline(alpha, color="grey", ls=":", label=f"this run α = {alpha:g}")
        ax.plot([alpha] * len(pools), [point[p.name][0] for p in pools], "ko", ms=4)
    ax.set_yscale("log")
    ax.set_xlabel(f"{' + '.join(pools[0].components)} budget fraction α")
    ax.set_ylabel("effective noise multiplier σ_eff")
    ax.set_title("Per-pool effective noise (α-split)")
    ax.legend(fontsize=8)
    return _save(fig, path, integer_x=False)


def plot_metrics(rounds: Table, path: Path, columns: Sequence[str]) -> Path:
    """One panel per metric column against the round (round 0 = the starting model)."""
    fig = Figure(figsize=(7, 2.6 * len(columns) + 0.6))
    axes = fig.subplots(len(columns), 1, sharex=True, squeeze=False)[:, 0]
    for ax, column in zip(axes, columns, strict=True):
        ax.plot(*series(rounds, column), "-o", ms=3)
        ax.set_ylabel(column)
        ax.grid(alpha=0.3)
    axes[0].set_title("Metrics by round")
    axes[-1].set_xlabel("round")
    return _save(fig, path)


def plot_epsilon(rounds: Table, path: Path, *, accountant: str = "rdp") -> Path:
    """Privacy spent (epsilon at the run's delta) after each round.

    ``rounds.csv``'s ``epsilon`` is the per-round figure of FLConfig's ``round_accountant``
    (``rdp`` by default, an upper bound of the PLD guarantee in results.json); the axis names it.
    """
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.plot(*series(rounds, "epsilon"), "-o", ms=3, color="tab:red")
    ax.set_xlabel("round")
    ax.set_ylabel(f"ε so far ({accountant.upper()})")
    ax.set_title("Privacy spent (the run's guarantee: results.json)")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_runs_by_round(
    runs: dict[str, dict[str, Table]],
    path: str | Path,
    *,
    column: str = "WER",
    title: str = "Dev WER by round",
) -> Path:
    """One metric of many runs against the round, on shared axes (one panel per group).

    Arguments
    ---------
    runs : dict
        ``{panel title: {run label: rounds table}}`` (``rounds.csv`` read by
        :func:`speechbrain_fl.run_outputs.read_rounds`); e.g. one panel per encoder variant,
        one line per privacy method. Runs without values in ``column`` are left out (logged).
    path : str or Path
        The PNG to write.
    column : str
        The ``rounds.csv`` column to draw (round 0 = the starting model).
    title : str
        Figure title.

    Returns
    -------
    Path

    Example
    -------
    >>> import tempfile
    >>> t = {"round": np.array([0.0, 1.0]), "WER": np.array([0.5, 0.4])}
    >>> plot_runs_by_round({"frozen": {"FedAvg": t}}, Path(tempfile.mkdtemp()) / "w.png").name
    'w.png'
    """
    panels = {name: table for name, table in runs.items() if table}
    if not panels:
        raise ValueError("plot_runs_by_round: no runs to draw")
    fig = Figure(figsize=(5.2 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    labels = list(dict.fromkeys(label for tables in panels.values() for label in tables))
    for ax, (name, tables) in zip(axes, panels.items(), strict=True):
        for label, table in tables.items():
            index = labels.index(label)  # one color per run label across panels
            if not has_values(table, column):
                _skip(f"{label} in {path}", f"no {column} values")
                continue
            ax.plot(
                *series(table, column), "-o", ms=3, label=label,
                color=_PALETTE[index % len(_PALETTE)],
            )  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(column)
    fig.suptitle(title)
    return _save(fig, Path(path))


def _skip(name: str, reason: str) -> None:
    logger.info("plots: skipped %s (%s)", name, reason)


def write_run_plots(
    output_folder: str | Path,
    *,
    noise_multiplier: float | None,
    clip: float | None,
    alpha: float | None = None,
    expected_cohort_size: float | None = None,
    round_accountant: str = "rdp",
) -> list[Path]:
    """Write every figure the run's logs support to ``<output_folder>/plots/``.

    Arguments
    ---------
    output_folder : str or Path
        Holds ``rounds.csv`` and ``group_norms.csv``.
    noise_multiplier : float or None
        sigma; ``None`` or 0 for a run without DP (no noise floor, no sigma_eff figure).
    clip : float or None
        The joint clip C; ``None`` without clipping.
    alpha : float, optional
        The alpha-split encoder fraction, marked on the sigma_eff figure.
    expected_cohort_size : float, optional
        n of the noise floor; by default the mean ``cohort_size`` of rounds >= 1.
    round_accountant : str
        The accountant of ``rounds.csv``'s per-round ``epsilon`` (FLConfig's
        ``round_accountant``), named on the epsilon figure's axis.

    Returns
    -------
    list of Path
        The PNG files written.
    """
    folder = Path(output_folder)
    plots = folder / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    rounds = read_rounds(folder)
    if rounds is None:
        _skip("round figures", f"{folder / 'rounds.csv'} not found")
    elif expected_cohort_size is None:
        expected_cohort_size = mean_cohort_size(rounds)

    table = read_group_norms(folder)
    if table is None:
        _skip("group_norms.png", f"{folder / 'group_norms.csv'} not found")
    elif not has_values(table, "mean_norm"):
        _skip("group_norms.png", "no mean_norm values")
    else:
        floor = None
        if noise_multiplier and clip and expected_cohort_size:
            floor = noise_floor(
                noise_multiplier=noise_multiplier,
                clip=clip,
                expected_cohort_size=expected_cohort_size,
            )
        else:
            _skip("noise floor band", "needs noise_multiplier, clip and a cohort size")
        noise = None
        if floor is not None and "numel" in table:
            noise = {
                str(name): noise_floor(
                    noise_multiplier=noise_multiplier,
                    clip=clip,
                    expected_cohort_size=expected_cohort_size,
                    numel=float(numel),
                )
                for name, numel in zip(table["group"], table["numel"], strict=True)
                if np.isfinite(numel)
            }
        written.append(plot_group_norms(table, plots / "group_norms.png", floor=floor, noise=noise))

    if rounds is not None:
        if has_values(rounds, "joint_norm_mean"):
            written.append(
                plot_clipping_dynamics(rounds, plots / "clipping_dynamics.png", clip=clip)
            )
        else:
            _skip("clipping_dynamics.png", "no joint_norm_mean values")
        if component_labels(rounds, "clip_rate") or component_labels(rounds, "budget"):
            written.append(plot_component_clipping(rounds, plots / "component_clipping.png"))
        else:
            _skip("component_clipping.png", "no clip_rate_<component>/budget_<component> values")
        metrics = metric_columns(rounds)
        if metrics:
            written.append(plot_metrics(rounds, plots / "metrics_by_round.png", metrics))
        else:
            _skip("metrics_by_round.png", "no metric columns with values")
        if has_values(rounds, "epsilon"):
            written.append(
                plot_epsilon(rounds, plots / "epsilon_by_round.png", accountant=round_accountant)
            )
        else:
            _skip("epsilon_by_round.png", "no epsilon values (run without DP)")

    if noise_multiplier:
        written.append(
            plot_effective_noise(
                plots / "effective_noise.png", noise_multiplier=noise_multiplier, alpha=alpha
            )
        )
    else:
        _skip("effective_noise.png", "no noise multiplier (run without DP)")
    for path in written:
        logger.info("plots: wrote %s", path)
    return written


def write_exit_plots(output_folder: str | Path, *, prefixes: Sequence[str] = ("acc_", "wer_")):
    """The metric of every exit by round (``plots/metric_by_round.png``) from ``rounds.csv``.

    The figure of an early-exit run (SUPERB): one panel per ``acc_<exit>`` / ``wer_<exit>``
    column. Returns the PNG files written (none when ``rounds.csv`` has no such column).
    """
    folder = Path(output_folder)
    rounds = read_table(folder / "rounds.csv")
    columns = [c for c in rounds if c.startswith(tuple(prefixes))]
    if not columns:
        _skip("metric_by_round.png", f"no {'/'.join(prefixes)} columns in rounds.csv")
        return []
    (folder / "plots").mkdir(parents=True, exist_ok=True)
    return [plot_metrics(rounds, folder / "plots" / "metric_by_round.png", columns)]

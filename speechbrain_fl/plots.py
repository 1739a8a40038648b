"""The figures every federated run writes to ``<output_folder>/plots/``.

They reproduce the diagnostic figures of the alpha-split paper from one run's own logs
(``rounds.csv`` and ``group_norms.csv``, formats in ``docs/api.md``, "Run outputs"):

- ``group_norms.png`` (Fig. 2): mean update norm per trainable group, sorted descending, log
  scale, colored by component, with the Gaussian noise floor ``sigma * C / sqrt(n)``.
- ``clipping_dynamics.png`` (Fig. 3): mean joint update norm (left axis) with the clip ``C``,
  client clip rate and mean clip ratio ``r_bar = mean_i min(1, C / ||Delta theta_i||)`` (right
  axis); second panel: mean update norm per component per round.
- ``component_clipping.png`` (Fig. 5): per-component clip rate per round; per-component mean
  norm with its pool budget dashed.
- ``effective_noise.png`` (Fig. 4): ``sigma_eff`` of the encoder pool ``sigma / sqrt(alpha)``
  and of the LLM + connector pool ``sigma / sqrt(1 - alpha)`` (Section IV-A4) against alpha, the
  flat-DP reference ``sigma`` and the run's alpha.
- ``metrics_by_round.png``: every metric column (WER, valid_loss, ...) against the round.
- ``epsilon_by_round.png``: the privacy spent so far.

A figure whose inputs are absent (a FedAvg run has no budgets, noise or epsilon) is skipped
with a log line, never an error. Figures are drawn on ``matplotlib.figure.Figure`` objects with
the Agg canvas, without pyplot, so nothing global (backend, open figures) is touched.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from speechbrain_fl.run_outputs import COMPONENT_PREFIXES, ROUND_COLUMNS

logger = logging.getLogger(__name__)

# The paper's colors for its components (Fig. 2/3); other labels take the next tab10 colors.
COMPONENT_COLORS = {"encoder": "tab:blue", "connector": "tab:orange", "llm": "tab:green"}
_EXTRA_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def component_color(label: str, labels: Sequence[str] = ()) -> str:
    """Color of a component label: the paper's for encoder/connector/llm, tab10 otherwise."""
    if label in COMPONENT_COLORS:
        return COMPONENT_COLORS[label]
    others = [lab for lab in labels if lab not in COMPONENT_COLORS] or [label]
    position = others.index(label) if label in others else len(others)
    return _EXTRA_COLORS[position % len(_EXTRA_COLORS)]


def read_table(path: str | Path, *, text_columns: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """Read a run CSV into columns: floats (empty cell = NaN) except ``text_columns`` (str).

    Raises ``ValueError`` naming the file, column and row of a non-numeric cell.

    Example
    -------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "r.csv")
    >>> _ = open(p, "w").write("round,WER\\n0,\\n1,0.5\\n")
    >>> read_table(p)["WER"].tolist()
    [nan, 0.5]
    """
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    table = {}
    for column in header:
        cells = [row.get(column) or "" for row in rows]
        if column in text_columns:
            table[column] = np.array(cells, dtype=str)
            continue
        values = np.full(len(cells), np.nan)
        for i, cell in enumerate(cells):
            if cell.strip():
                try:
                    values[i] = float(cell)
                except ValueError as err:
                    raise ValueError(
                        f"{path}: column {column!r}, data row {i + 1}: {cell!r} is not a number"
                    ) from err
        table[column] = values
    return table


def _finite(table: dict[str, np.ndarray], column: str) -> bool:
    return column in table and bool(np.isfinite(table[column]).any())


def _components(table: dict[str, np.ndarray], prefix: str) -> list[str]:
    """Component labels L with a non-empty ``<prefix><L>`` column."""
    labels = []
    for column in table:
        if not column.startswith(prefix) or not _finite(table, column):
            continue
        labels.append(column[len(prefix) :])
    return labels


def _series(table, column):
    """(rounds, values) with the NaN cells of ``column`` dropped."""
    rounds, values = table["round"], table[column]
    keep = np.isfinite(values) & np.isfinite(rounds)
    return rounds[keep], values[keep]


def _save(fig: Figure, path: Path, *, integer_x: bool = True) -> Path:
    FigureCanvasAgg(fig)
    if integer_x:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def noise_floor(*, noise_multiplier: float, clip: float, expected_cohort_size: float) -> float:
    """The paper's noise floor ``sigma * C / sqrt(n)`` (Fig. 2).

    Example
    -------
    >>> round(noise_floor(noise_multiplier=0.1, clip=1.0, expected_cohort_size=94), 4)
    0.0103
    """
    if expected_cohort_size <= 0:
        raise ValueError(f"expected_cohort_size must be > 0, got {expected_cohort_size}")
    return noise_multiplier * clip / math.sqrt(expected_cohort_size)


def effective_noise_curve(
    noise_multiplier: float, alphas: Sequence[float] | np.ndarray
) -> dict[str, np.ndarray]:
    """Per-pool effective noise multipliers of alpha-split (Section IV-A4).

    The encoder pool is clipped to ``C sqrt(alpha)`` and the LLM + connector pool to
    ``C sqrt(1 - alpha)`` while the noise is calibrated to ``C``, so
    ``sigma_eff_enc = sigma / sqrt(alpha)`` and ``sigma_eff_llm = sigma / sqrt(1 - alpha)``.

    Example
    -------
    >>> c = effective_noise_curve(0.1, [0.05])
    >>> round(float(c["encoder"][0]), 3), round(float(c["llm"][0]), 3)
    (0.447, 0.103)
    """
    alphas = np.asarray(alphas, dtype=np.float64)
    if np.any((alphas <= 0) | (alphas >= 1)):
        raise ValueError("alpha must lie strictly between 0 and 1")
    return {
        "alpha": alphas,
        "encoder": noise_multiplier / np.sqrt(alphas),
        "llm": noise_multiplier / np.sqrt(1.0 - alphas),
    }


def plot_group_norms(
    group_norms: dict[str, np.ndarray],
    path: Path,
    *,
    floor: float | None = None,
) -> Path:
    """Fig. 2: mean update norm per group over the rounds, sorted descending, log scale.

    Arguments
    ---------
    group_norms : dict
        Columns of ``group_norms.csv`` (``group``, ``component`` as text).
    path : Path
        The PNG to write.
    floor : float, optional
        Noise floor ``sigma * C / sqrt(n)`` drawn as a band below it.

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
    labels = list(dict.fromkeys(component_of[names[i]] for i in order))
    fig = Figure(figsize=(max(6.0, min(16.0, 0.12 * len(names) + 4)), 4))
    ax = fig.add_subplot()
    heights = np.maximum(np.array(means)[order], np.finfo(float).tiny)
    colors = [component_color(component_of[names[i]], labels) for i in order]
    ax.bar(np.arange(len(order)), heights, color=colors, width=0.85)
    handles = [Patch(color=component_color(label, labels), label=label) for label in labels]
    if floor is not None and floor > 0:
        ax.axhspan(min(heights.min(), floor) / 2, floor, color="pink", alpha=0.5, zorder=0)
        handles.append(
            ax.axhline(floor, color="deeppink", lw=1, label=f"noise floor σC/√n = {floor:.3g}")
        )
    ax.set_yscale("log")
    ax.set_xlabel("trainable group (sorted by mean norm)")
    ax.set_ylabel("mean update norm ‖Δθ_h‖₂")
    ax.set_title("Per-group mean update norm")
    ax.legend(handles=handles, fontsize=8)
    return _save(fig, path)


def plot_clipping_dynamics(
    rounds: dict[str, np.ndarray], path: Path, *, clip: float | None = None
) -> Path:
    """Fig. 3: mean joint norm, clip rate and mean clip ratio per round; component norms below."""
    components = _components(rounds, "norm_")
    fig = Figure(figsize=(7, 6 if components else 4))
    axes = fig.subplots(2 if components else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    ax.plot(*_series(rounds, "joint_norm_mean"), "k--o", ms=3, label="mean joint norm")
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
        if _finite(rounds, c)
    ]
    if rates:
        right = ax.twinx()
        for column, color, name in rates:
            right.plot(*_series(rounds, column), "-o", color=color, ms=3, label=name)
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
                *_series(rounds, f"norm_{label}"),
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


def plot_component_clipping(rounds: dict[str, np.ndarray], path: Path) -> Path:
    """Fig. 5: per-component clip rate (top); per-component norm with dashed budget (bottom)."""
    labels = list(
        dict.fromkeys(
            _components(rounds, "clip_rate_")
            + _components(rounds, "norm_")
            + _components(rounds, "budget_")
        )
    )
    fig = Figure(figsize=(7, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for label in labels:
        color = component_color(label, labels)
        if _finite(rounds, f"clip_rate_{label}"):
            top.plot(*_series(rounds, f"clip_rate_{label}"), "-o", ms=3, color=color, label=label)
        if _finite(rounds, f"norm_{label}"):
            bottom.plot(*_series(rounds, f"norm_{label}"), "-o", ms=3, color=color, label=label)
        if _finite(rounds, f"budget_{label}"):
            bottom.plot(
                *_series(rounds, f"budget_{label}"),
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
    """Fig. 4: sigma_eff of the encoder and LLM pools against alpha, flat reference, run's alpha."""
    curve = effective_noise_curve(noise_multiplier, np.linspace(0.01, 0.99, 197))
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(curve["alpha"], curve["encoder"], color="tab:red", label="encoder σ/√α")
    ax.plot(curve["alpha"], curve["llm"], color="tab:blue", label="LLM + connector σ/√(1−α)")
    ax.axhline(noise_multiplier, color="k", ls="--", label=f"flat DP σ = {noise_multiplier:g}")
    if alpha is not None and 0.0 < alpha < 1.0:
        point = effective_noise_curve(noise_multiplier, [alpha])
        ax.axvline(alpha, color="grey", ls=":", label=f"this run α = {alpha:g}")
        ax.plot([alpha, alpha], [point["encoder"][0], point["llm"][0]], "ko", ms=4)
    ax.set_yscale("log")
    ax.set_xlabel("encoder budget fraction α")
    ax.set_ylabel("effective noise multiplier σ_eff")
    ax.set_title("Per-component effective noise (α-split)")
    ax.legend(fontsize=8)
    return _save(fig, path, integer_x=False)


def metric_columns(rounds: dict[str, np.ndarray]) -> list[str]:
    """Columns of rounds.csv that hold metrics: neither fixed nor per-component, with data."""
    return [
        c
        for c in rounds
        if c not in ROUND_COLUMNS and not c.startswith(COMPONENT_PREFIXES) and _finite(rounds, c)
    ]


def plot_metrics(rounds: dict[str, np.ndarray], path: Path, columns: Sequence[str]) -> Path:
    """One panel per metric column against the round (round 0 = the starting model)."""
    fig = Figure(figsize=(7, 2.6 * len(columns) + 0.6))
    axes = fig.subplots(len(columns), 1, sharex=True, squeeze=False)[:, 0]
    for ax, column in zip(axes, columns, strict=True):
        ax.plot(*_series(rounds, column), "-o", ms=3)
        ax.set_ylabel(column)
        ax.grid(alpha=0.3)
    axes[0].set_title("Metrics by round")
    axes[-1].set_xlabel("round")
    return _save(fig, path)


def plot_epsilon(rounds: dict[str, np.ndarray], path: Path) -> Path:
    """Privacy spent (epsilon at the run's delta) after each round."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.plot(*_series(rounds, "epsilon"), "-o", ms=3, color="tab:red")
    ax.set_xlabel("round")
    ax.set_ylabel("ε so far")
    ax.set_title("Privacy spent")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _skip(name: str, reason: str) -> None:
    logger.info("plots: skipped %s (%s)", name, reason)


def write_run_plots(
    output_folder: str | Path,
    *,
    noise_multiplier: float | None,
    clip: float | None,
    alpha: float | None = None,
    expected_cohort_size: float | None = None,
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

    Returns
    -------
    list of Path
        The PNG files written.
    """
    folder = Path(output_folder)
    plots = folder / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    rounds = None
    rounds_csv = folder / "rounds.csv"
    if rounds_csv.is_file():
        rounds = read_table(rounds_csv)
        if "round" not in rounds:
            raise ValueError(f"{rounds_csv}: no 'round' column; header is {list(rounds)}")
    else:
        _skip("round figures", f"{rounds_csv} not found")

    if expected_cohort_size is None and rounds is not None and "cohort_size" in rounds:
        sizes = rounds["cohort_size"][(rounds["round"] >= 1) & np.isfinite(rounds["cohort_size"])]
        expected_cohort_size = float(sizes.mean()) if sizes.size and sizes.mean() > 0 else None

    group_csv = folder / "group_norms.csv"
    if not group_csv.is_file():
        _skip("group_norms.png", f"{group_csv} not found")
    else:
        table = read_table(group_csv, text_columns=("group", "component"))
        missing = [c for c in ("group", "component", "mean_norm") if c not in table]
        if missing:
            raise ValueError(f"{group_csv}: missing column(s) {missing}")
        if not _finite(table, "mean_norm"):
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
            written.append(plot_group_norms(table, plots / "group_norms.png", floor=floor))

    if rounds is not None:
        if _finite(rounds, "joint_norm_mean"):
            written.append(
                plot_clipping_dynamics(rounds, plots / "clipping_dynamics.png", clip=clip)
            )
        else:
            _skip("clipping_dynamics.png", "no joint_norm_mean values")
        if _components(rounds, "clip_rate_") or _components(rounds, "budget_"):
            written.append(plot_component_clipping(rounds, plots / "component_clipping.png"))
        else:
            _skip("component_clipping.png", "no clip_rate_<component>/budget_<component> values")
        metrics = metric_columns(rounds)
        if metrics:
            written.append(plot_metrics(rounds, plots / "metrics_by_round.png", metrics))
        else:
            _skip("metrics_by_round.png", "no metric columns with values")
        if _finite(rounds, "epsilon"):
            written.append(plot_epsilon(rounds, plots / "epsilon_by_round.png"))
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

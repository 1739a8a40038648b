"""The MLS grid's test CE with CIs and FedAvg against the central ceiling, from the run folders.

- :func:`ce_rows` / :func:`ce_pairs`: the test transcript CE of each method pooled over the
  seeds, with its speaker-level 95% CI, and the paired CE comparisons of
  :data:`seed_table.PAIRS`, from each run's ``test_ce_utterances.csv`` (``test_ce.py``).
- :func:`ceiling`: the centralized runs (``train_fl.py --scenario centralized`` into
  ``<grid>/seed<S>/central/...``) against FedAvg at the same seeds: the ceiling's WER, its
  change from round 0, and the share of the round-0-to-ceiling gap FedAvg closes,

      closure = (E_0 - E_fedavg) / (E_0 - E_central)

  with E the edits summed over the pooled seeds' test utterances (the reference words cancel),
  its 95% CI from one speaker-level bootstrap drawn for the three systems together.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from compare import pool_seeds
from method_tables import run_folder
from seed_table import PAIRS, seed_root

from speechbrain_fl.metrics import (
    align_utterances,
    bootstrap_details,
    paired_bootstrap_details,
    read_utterance_details,
)
from speechbrain_fl.metrics.resampling import speaker_bootstrap, speaker_totals

CE_FILE = "test_ce_utterances.csv"
CENTRAL = "central"
#: The share of the round-0-to-ceiling gap the FedAvg default is to close (issue target).
CLOSURE_TARGET = 0.65


def pooled(folders, name):
    """The seeds' per-utterance files ``name`` as one set (:func:`compare.pool_seeds`)."""
    return pool_seeds([read_utterance_details(Path(f) / name) for f in folders])


def _paired(a_runs, b_runs):
    """``{seed folder name: run folder}`` of each side, restricted to the shared seeds."""
    a = {f.parent.parent.name: f for f in a_runs}
    b = {f.parent.parent.name: f for f in b_runs}
    shared = sorted(set(a) & set(b))
    return [a[s] for s in shared], [b[s] for s in shared]


def ce_rows(done):
    """``{method: {"ce_pooled", "ce_ci"}}`` for the methods whose every seed has a CE file."""
    out = {}
    for method, runs in done.items():
        folders = [f for f, _ in runs]
        if not all((Path(f) / CE_FILE).is_file() for f in folders):
            continue
        ci = bootstrap_details(pooled(folders, CE_FILE))
        out[method] = {"ce_pooled": ci.wer, "ce_ci": [ci.ci_low, ci.ci_high]}
    return out


def ce_pairs(done, pairs=PAIRS):
    """Paired, seed-pooled ``CE_A - CE_B`` for each pair with CE files at shared seeds."""
    out = []
    for a, b in pairs:
        a_runs = [f for f, _ in done.get(a, []) if (f / CE_FILE).is_file()]
        b_runs = [f for f, _ in done.get(b, []) if (f / CE_FILE).is_file()]
        a_runs, b_runs = _paired(a_runs, b_runs)
        if not a_runs:
            continue
        res = paired_bootstrap_details(pooled(a_runs, CE_FILE), pooled(b_runs, CE_FILE))
        out.append(
            {"a": a, "b": b, "seeds": len(a_runs), "difference": res.difference,
             "ci95": [res.ci_low, res.ci_high], "p": res.p_value, "significant": res.significant}
        )  # fmt: skip
    return out


def closure(start, fedavg, central, *, num_resamples=10000, seed=0):
    """FedAvg's share of the gap from round 0 to the ceiling, with its speaker-level 95% CI.

    ``start``, ``fedavg``, ``central``: per-utterance WER counts on the same utterances.
    Returns ``(closure, ci_low, ci_high)``.

    Example
    -------
    >>> import numpy as np
    >>> from speechbrain_fl.metrics import UtteranceErrors
    >>> def d(edits):
    ...     return UtteranceErrors(("1", "2"), ("s", "t"), ("", ""), np.array(edits),
    ...                            np.array([4, 4]))
    >>> closure(d([4, 4]), d([2, 3]), d([1, 1]), num_resamples=200)[0]
    0.5
    """
    start, fedavg = align_utterances(start, fedavg)
    _, central = align_utterances(start, central)
    _, totals = speaker_totals(
        speakers=start.speakers, e0=start.num_edits, ef=fedavg.num_edits, ec=central.num_edits
    )
    table = np.stack([totals["e0"], totals["ef"], totals["ec"]], axis=1)

    def statistic(sums):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (sums[0] - sums[1]) / (sums[0] - sums[2])

    point = float(statistic(table.sum(axis=0)))
    boot = speaker_bootstrap(table, statistic, num_resamples=num_resamples, seed=seed)
    return point, float(boot.ci_low), float(boot.ci_high)


def ceiling(root, seeds, variant="unfrozen"):
    """The central ceiling and FedAvg's gap closure at the seeds where both runs finished.

    Returns ``None`` when no seed has both; else the ceiling's pooled WER and CE, its paired
    change from round 0, ``central - fedavg`` (paired) and the closure with its CI.
    """
    both = [
        (run_folder(seed_root(root, s), CENTRAL, variant), run_folder(seed_root(root, s),
         "fedavg", variant), s)
        for s in seeds
    ]  # fmt: skip
    both = [(c, f, s) for c, f, s in both if (c / "results.json").is_file()
            and (f / "results.json").is_file()]  # fmt: skip
    if not both:
        return None
    centrals, fedavgs = [c for c, _, _ in both], [f for _, f, _ in both]
    central = pooled(centrals, "test_utterances.csv")
    fedavg = pooled(fedavgs, "test_utterances.csv")
    start = pooled(fedavgs, "test_utterances_round0.csv")
    change = paired_bootstrap_details(central, start)
    versus = paired_bootstrap_details(central, fedavg)
    share, low, high = closure(start, fedavg, central)
    ce = bootstrap_details(pooled(centrals, CE_FILE))
    return {
        "seeds": [s for _, _, s in both],
        "wers": [read_utterance_details(c / "test_utterances.csv").wer for c in centrals],
        "wer_pooled": central.wer,
        "wer_round0": start.wer,
        "wer_fedavg": fedavg.wer,
        "change": change.difference,
        "change_ci": [change.ci_low, change.ci_high],
        "central_minus_fedavg": versus.difference,
        "central_minus_fedavg_ci": [versus.ci_low, versus.ci_high],
        "central_minus_fedavg_p": versus.p_value,
        "closure": share,
        "closure_ci": [low, high],
        "closure_target": CLOSURE_TARGET,
        "ce_pooled": ce.wer,
        "ce_ci": [ce.ci_low, ce.ci_high],
    }

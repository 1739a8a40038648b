#!/usr/bin/env python3
"""Per-utterance test cross-entropy of finished MLS runs, for CIs on the test CE.

For each run folder (a ``train_fl.py`` output folder with ``final_model/`` and
``results.json``) that has no ``test_ce_utterances.csv`` yet, this script loads the final
model (:func:`speechbrain_fl.models.checkpoint.load_federated_model`), scores every test
utterance's transcript cross-entropy with its own audio, one utterance a batch
(:func:`mls_report.utterance_ce`), and writes ``test_ce_utterances.csv`` into the run folder in
the columns of ``test_utterances.csv``: ``num_edits`` = n_u * CE_u (the CE summed over the
utterance's n_u target tokens), ``num_ref_tokens`` = n_u. ``readme_results.py collect`` then
gives the test CE a speaker-level bootstrap CI and paired comparisons, as the WER.

Usage::

    > python recipes/MLS/studies/test_ce.py --grid GRID_ROOT --seeds 11 12 13
    > python recipes/MLS/studies/test_ce.py RUN_FOLDER [RUN_FOLDER ...]

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

STUDY_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(STUDY_DIR.parent))  # the recipe's modules
sys.path.insert(0, str(STUDY_DIR))
from mls_brain import make_dataset  # noqa: E402
from mls_report import utterance_ce  # noqa: E402
from seed_table import seed_root  # noqa: E402

from speechbrain_fl.data.partition import read_manifest  # noqa: E402
from speechbrain_fl.metrics import write_utterance_details  # noqa: E402
from speechbrain_fl.models.checkpoint import load_federated_model  # noqa: E402

CE_FILE = "test_ce_utterances.csv"


def score_run(run: Path, *, device: str = "cpu") -> Path:
    """Write ``<run>/test_ce_utterances.csv`` from the run's final model and test manifest."""
    results = json.loads((run / "results.json").read_text())
    data_folder = results["data"]["data_folder"]
    test_csv = run / "save" / "manifests" / "test.csv"
    if not test_csv.is_file():
        raise FileNotFoundError(f"{run}: no test manifest at {test_csv}")
    model = load_federated_model(run / "final_model", device=device)
    brain = SimpleNamespace(modules=SimpleNamespace(model=model), device=device)
    details = utterance_ce(brain, make_dataset(str(test_csv), data_folder), read_manifest(test_csv))
    return write_utterance_details(run / CE_FILE, details)


def run_folders(grid: Path, seeds: list[int]) -> list[Path]:
    """Every finished run (``results.json`` and ``final_model/``) under the grid's seed roots."""
    found = []
    for seed in seeds:
        root = seed_root(grid, seed)
        found += sorted(p.parent for p in root.glob("*/*/results.json"))
    return [p for p in found if (p / "final_model").is_dir()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run folders")
    parser.add_argument("--grid", type=Path, help="method_table.py --output-root")
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--force", action="store_true", help="score runs that have the file")
    args = parser.parse_args(argv)
    runs = list(args.runs) + (run_folders(args.grid, args.seeds) if args.grid else [])
    if not runs:
        parser.error("give run folders or --grid")
    for run in runs:
        if (run / CE_FILE).is_file() and not args.force:
            continue
        print(f"{score_run(run, device=args.device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

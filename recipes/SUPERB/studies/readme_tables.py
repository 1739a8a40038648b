#!/usr/bin/env python3
"""Write the SUPERB README's result tables and the root README's SUPERB row from results files.

The one source of the recipe's reported figures is the JSON files of ``recipes/SUPERB/studies/``:

- ``default_kws12.json``: the default command's run (test accuracy per exit with its 95% CI,
  training memory per exit), copied from a run's ``results.json`` by ``--ingest_default``;
- ``memory_by_task.json``: exit 3 against exit 12 at wav2vec 2.0 Base size per task, written
  by ``memory_by_exit.py --per_task``;
- ``phone_seed.json``: the phone seed's per-layer probes (``phone_seed.py``'s output);
- ``depth_by_exit.json``: centralized runs at a shallow and a deep exit from the same start,
  one row per corpus and start, each with its paired difference (``--ingest_depth`` computes
  it from the runs' ``test_predictions.csv``, comma-separated folders one per seed: the
  (seed, speaker) bootstrap of ``results_table.paired_difference``).

From them it renders four tables into ``recipes/SUPERB/README.md``, between the markers
``<!-- results:superb-default:start -->`` / ``...:end -->`` (and ``superb-memory``,
``superb-depth``, ``superb-probes``), and the row of the root README's results table that
starts with ``| SUPERB`` (a table row cannot hold markers, so the row is found by its prefix).
``--check`` writes nothing and exits 1 naming every table that differs from its file.

    > python recipes/SUPERB/studies/readme_tables.py --ingest_default results/SUPERB/kws12/...
    > python recipes/SUPERB/studies/readme_tables.py
    > python recipes/SUPERB/studies/readme_tables.py --check

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parents[1]  # recipes/SUPERB
RESULTS = RECIPE_DIR / "studies"
README = RECIPE_DIR / "README.md"
ROOT_README = RECIPE_DIR.parents[1] / "README.md"
ROW_PREFIX = "| SUPERB "
TASK_NAMES = {"kws12": "KWS-12 (Speech Commands)", "sid": "SID (VoxCeleb1)",
              "er": "ER (IEMOCAP)", "asr": "ASR (LibriSpeech)"}  # fmt: skip


def load(name, results=RESULTS):
    """A results file of ``results`` as a dict; the error names the file."""
    path = Path(results) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: results file missing (see {Path(__file__).name})")
    return json.loads(path.read_text(encoding="utf-8"))


def _ci(entry, metric="accuracy"):
    lo, hi = entry["ci95"]
    return f"{entry[metric]:.3f} [{lo:.3f}, {hi:.3f}]"


def _row(memory, task, front_end):
    return next(r for r in memory["rows"] if r["task"] == task and r["front_end"] == front_end)


def default_table(default, memory):
    """The headline table: the default run per exit and exit 3's memory saving at Base size."""
    lines = ["| Figure | Paper | This repo |", "|---|---|---|"]
    for exit_, entry in sorted(default["test"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| KWS-12 test accuracy, exit {exit_} [95% CI] | lost | {_ci(entry)} |")
    for task in ("kws12", "asr"):
        saved = _row(memory, task, "trained")["saved"]
        lines.append(
            f"| Training memory saved, exit 3 vs 12, {TASK_NAMES[task].split(' ')[0]}, Base "
            f"(tensors of a step) | {_row(memory, task, 'trained')['paper_saving_pct']:.2f}% | "
            f"{saved['saving_pct']:.1f}% ({saved['exit3_mib']:.0f} vs {saved['exit12_mib']:.0f}"
            " MiB) |"
        )
    return "\n".join(lines)


MEASURE_NAMES = {"saved": "tensors", "peak": "peak", "resident": "peak, all layers resident"}


def memory_table(memory):
    """Exit 3 vs exit 12 per task and CNN front-end: the paper's saving and ours per measure."""
    lines = [
        "| Task, clip length | CNN front-end | Paper | Tensors of the step | Peak of the step "
        "| Peak, all layers resident |",
        "|---|---|---|---|---|---|",
    ]
    for task in TASK_NAMES:
        for front_end in ("frozen", "trained"):
            row = _row(memory, task, front_end)
            cells = [
                f"{row[m]['saving_pct']:.1f}% "
                f"({row[m]['exit3_mib']:.0f} / {row[m]['exit12_mib']:.0f})"
                for m in MEASURE_NAMES
            ]
            lines.append(
                f"| {TASK_NAMES[task]}, {row['seconds']:g} s | {front_end} | "
                f"{row['paper_saving_pct']:.2f}% | " + " | ".join(cells) + " |"
            )
    order = memory["paper_order_kws_sid_er_asr"]
    matching = [
        f"{name}, CNN {front_end}"
        for measure, name in MEASURE_NAMES.items()
        for front_end in ("frozen", "trained")
        if order[f"{measure}_{front_end}"]
    ]
    lines.append("")
    lines.append(
        f"Batch {memory['batch_size']}, model {memory['model']}; cells: saving (exit 3 / exit 12"
        " MiB). The paper's ordering KWS > SID > ER > ASR holds under: "
        + (", ".join(matching) if matching else "none of the measures")
        + "."
    )
    return "\n".join(lines)


def depth_table(depth):
    """Centralized deep exit minus exit 3 per corpus and starting point, paired."""
    lines = [
        "| Corpus, starting point | Seeds | Exit 3 | Deep exit | Deep - exit 3 [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for row in depth["rows"]:
        diff = row["difference"]
        diff_text = "n/a" if diff is None else f"{diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]"
        lines.append(
            f"| {row['label']} | {row['seeds']} | {row['shallow']:.3f} | "
            f"{row['deep']:.3f} (exit {row['deep_exit']}) | {diff_text} |"
        )
    return "\n".join(lines)


def probe_table(probes):
    """Linear-probe accuracy per layer on frozen states: the random model and the phone seed."""
    lines = [
        "| Layer | Phone (content), random | Phone (content), seed | Voice (speaker), random "
        "| Voice (speaker), seed |",
        "|---|---|---|---|---|",
    ]
    random, seed = probes["probes"]["random"], probes["probes"]["phone_seed"]
    for layer in sorted(random["content"], key=int):
        lines.append(
            f"| {layer} | {random['content'][layer]:.3f} | {seed['content'][layer]:.3f} | "
            f"{random['speaker'][layer]:.3f} | {seed['speaker'][layer]:.3f} |"
        )
    settings = probes["settings"]
    lines.append("")
    lines.append(
        f"Seed: {settings['speakers']} public voices x {settings['utterances']} sentences, "
        f"{len(probes['phones'])} frame labels, {settings['steps']} steps (loss "
        f"{probes['loss_first_50']:.2f} -> {probes['loss_last_50']:.2f}, first and last 50 "
        f"steps); probes on {settings['probe_speakers']} other voices x "
        f"{settings['probe_utterances']} sentences (chance: voice 1/{settings['probe_speakers']})."
    )
    return "\n".join(lines)


def root_row(default, memory):
    """The SUPERB row of the root README's results table."""
    tests = sorted(default["test"].items(), key=lambda kv: int(kv[0]))
    accuracy = ", ".join(f"{e[1]['accuracy']:.3f} at exit {e[0]}" for e in tests)
    kws = _row(memory, "kws12", "trained")["saved"]
    return (
        f"| SUPERB KWS-12 | Test accuracy {accuracy} ({default['rounds']} rounds, one seed); "
        f"training memory exit 3 vs 12 at wav2vec 2.0 Base size: -{kws['saving_pct']:.1f}% "
        f"(tensors of one step, batch {memory['batch_size']}, 1-s clips) | Accuracy tables lost "
        f"from the paper's text; memory -{_row(memory, 'kws12', 'trained')['paper_saving_pct']}"
        "% (KWS) |"
    )


def render(results=RESULTS):
    """``({table name: markdown}, root README row)`` from the results files."""
    default = load("default_kws12.json", results)
    memory = load("memory_by_task.json", results)
    tables = {
        "results:superb-default": default_table(default, memory),
        "results:superb-memory": memory_table(memory),
        "results:superb-depth": depth_table(load("depth_by_exit.json", results)),
        "results:superb-probes": probe_table(load("phone_seed.json", results)),
    }
    return tables, root_row(default, memory)


def differences(readme=README, root_readme=ROOT_README, results=RESULTS):
    """Names of the tables (and ``root-row``) whose README text differs from the results."""
    from speechbrain_fl.recipe.report import insert_table

    tables, row = render(results)
    text = Path(readme).read_text(encoding="utf-8")
    out = [name for name, markdown in tables.items() if insert_table(text, name, markdown) != text]
    if row not in Path(root_readme).read_text(encoding="utf-8").splitlines():
        out.append("root-row")
    return out


def write(readme=README, root_readme=ROOT_README, results=RESULTS):
    """Write the four tables into ``readme`` and the row into ``root_readme``."""
    from speechbrain_fl.recipe import update_readme_table

    tables, row = render(results)
    for name, markdown in tables.items():
        update_readme_table(readme, name, markdown)
    path = Path(root_readme)
    lines = path.read_text(encoding="utf-8").split("\n")
    hits = [i for i, line in enumerate(lines) if line.startswith(ROW_PREFIX)]
    if len(hits) != 1:
        raise ValueError(f"{path}: {len(hits)} lines start with {ROW_PREFIX!r}; one is needed")
    lines[hits[0]] = row
    path.write_text("\n".join(lines), encoding="utf-8")


def ingest_default(folder, results=RESULTS):
    """Copy what the tables read from a default run's ``results.json``."""
    run = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
    keys = ("task", "scenario", "aggregation", "weighting", "rounds", "num_clients", "seed")
    keep = {k: run[k] for k in (*keys, "test", "memory_mb") if k in run}
    (Path(results) / "default_kws12.json").write_text(json.dumps(keep, indent=1) + "\n")


def _seed_runs(folders):
    """The results of one exit's runs, one per seed (comma-separated run folders)."""
    runs = []
    for folder in folders.split(","):
        run = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
        if len(run["test"]) != 1:
            raise ValueError(f"{folder}: a centralized run tests one exit, not {list(run['test'])}")
        runs.append({**run, "_folder": str(folder), "_exit": next(iter(run["test"]))})
    if len({r["_exit"] for r in runs}) != 1:
        raise ValueError(f"{folders}: the runs test different exits")
    return runs


def ingest_depth(label, shallow_folders, deep_folders, results=RESULTS):
    """Append (or replace) a row of ``depth_by_exit.json`` from centralized runs.

    ``shallow_folders`` and ``deep_folders`` are comma-separated run folders, one per seed in
    the same seed order. Each exit's value is pooled over the seeds' test clips and the
    difference is paired over (seed, speaker) units (``results_table``'s bootstrap).
    """
    from results_table import paired_difference, pooled_accuracy

    shallow, deep = _seed_runs(shallow_folders), _seed_runs(deep_folders)
    if [r["seed"] for r in shallow] != [r["seed"] for r in deep]:
        raise ValueError("the shallow and deep runs must list the same seeds in the same order")
    exits = shallow[0]["_exit"], deep[0]["_exit"]
    diff = paired_difference(deep, exits[1], shallow, exits[0])
    values = [pooled_accuracy(runs, e) for runs, e in ((shallow, exits[0]), (deep, exits[1]))]
    row = {
        "label": label,
        "seeds": len(shallow),
        "seed_list": [r["seed"] for r in shallow],
        "metric": "accuracy",
        "shallow": values[0][0],
        "deep": values[1][0],
        "deep_exit": int(exits[1]),
        "per_seed": [
            [a["test"][exits[0]]["accuracy"], b["test"][exits[1]]["accuracy"]]
            for a, b in zip(shallow, deep, strict=True)
        ],
        "difference": None if diff is None else [diff[0], *diff[1]],
    }
    path = Path(results) / "depth_by_exit.json"
    table = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    table["rows"] = [r for r in table["rows"] if r["label"] != label] + [row]
    path.write_text(json.dumps(table, indent=1) + "\n")
    return row


def main(argv=None):
    """Write the tables (default), check them, or ingest a run first."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a README differs")
    parser.add_argument("--ingest_default", default=None, help="a default run's output folder")
    parser.add_argument("--ingest_depth", nargs=3, default=None,
                        metavar=("LABEL", "SHALLOW_RUNS", "DEEP_RUNS"))  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        stale = differences()
        if stale:
            print("out of date with the results files:", ", ".join(stale))
            return 1
        return 0
    if args.ingest_default:
        ingest_default(args.ingest_default)
    if args.ingest_depth:
        ingest_depth(*args.ingest_depth)
    write()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())

#!/usr/bin/env python3
"""Write the SUPERB README's result tables and the root README's SUPERB row from results files.

The one source of the recipe's reported figures is the JSON files of ``recipes/SUPERB/studies/``:

- ``default.json``: the default command's run (test accuracy per exit with its 95% CI,
  training memory per exit), copied from a run's ``results.json`` by ``--ingest_default``;
- ``table2_kws35.json``: the paper's Table 2 on the default task (homogeneous at the deep exit,
  heterogeneous with FedAvg, heterogeneous layer-wise; one run per seed each), written by
  ``--ingest_table2`` with pooled accuracies, paired differences and p-values;
- ``memory_by_task.json``: exit 3 against exit 12 at wav2vec 2.0 Base size per task, written
  by ``memory_by_exit.py --per_task``;
- ``phone_seed.json``: the phone seed's per-layer probes (``phone_seed.py``'s output);
- ``depth_by_exit.json``: centralized runs at a shallow and a deep exit from the same start,
  one row per corpus and start, each with its paired difference (``--ingest_depth`` computes
  it from the runs' ``test_predictions.csv``, comma-separated folders one per seed: the
  (seed, speaker) bootstrap of ``results_table.paired_difference``).

From them it renders five tables into ``recipes/SUPERB/README.md``, between the markers
``<!-- results:superb-default:start -->`` / ``...:end -->`` (and ``superb-table2``,
``superb-memory``, ``superb-depth``, ``superb-probes``), and the row of the root README's results table that
starts with ``| SUPERB`` (a table row cannot hold markers, so the row is found by its prefix).
``--check`` writes nothing and exits 1 naming every table that differs from its file.

    > python recipes/SUPERB/studies/readme_tables.py --ingest_default RUN "a 2-core CPU"
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

import numpy as np

RECIPE_DIR = Path(__file__).resolve().parents[1]  # recipes/SUPERB
RESULTS = RECIPE_DIR / "studies"
README = RECIPE_DIR / "README.md"
ROOT_README = RECIPE_DIR.parents[1] / "README.md"
ROW_PREFIX = "| SUPERB "
SHORT_NAMES = {"kws12": "KWS-12", "kws35": "KWS-35", "sid": "SID", "er": "ER", "asr": "ASR"}
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
    task = SHORT_NAMES[default["task"]]
    for exit_, entry in sorted(default["test"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {task} test accuracy, exit {exit_} [95% CI] | lost | {_ci(entry)} |")
    for task in ("kws12", "asr"):
        saved = _row(memory, task, "trained")["saved"]
        lines.append(
            f"| Training memory saved, exit 3 vs 12, {TASK_NAMES[task].split(' ')[0]}, Base "
            f"(tensors of a step) | {_row(memory, task, 'trained')['paper_saving_pct']:.2f}% | "
            f"{saved['saving_pct']:.1f}% ({saved['exit3_mib']:.0f} vs {saved['exit12_mib']:.0f}"
            " MiB) |"
        )
    timings = default.get("timings_s")
    if timings:
        parts = [f"corpus generation {timings['data']:.0f} s", f"seed {timings['seed']:.0f} s",
                 f"federated training {timings['training']:.0f} s",
                 f"test and memory {timings['evaluation'] + timings['memory']:.0f} s"]  # fmt: skip
        wall = default.get("wall_s")
        launch = "" if wall is None else f"{wall / 60:.1f} min from launch to exit; "
        lines += ["", f"Time from an empty cache: {launch}the run's own clock "
                  f"{timings['total'] / 60:.1f} min (" + ", ".join(parts)
                  + f"); {default['machine']}."]  # fmt: skip
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
    random, seed = probes["probes"]["random"], probes["probes"]["phone_seed"]
    layers = sorted(random["content"], key=int)
    lines = ["| Probe, model | " + " | ".join(f"L{layer}" for layer in layers) + " |",
             "|---|" + "---|" * len(layers)]  # fmt: skip
    for probe, name in (("content", "Phone (content)"), ("speaker", "Voice (speaker)")):
        for model, label in ((random, "random"), (seed, "seed")):
            cells = " | ".join(f"{model[probe][layer]:.3f}" for layer in layers)
            lines.append(f"| {name}, {label} | {cells} |")
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
        f"| SUPERB {SHORT_NAMES[default['task']]} | Test accuracy {accuracy} "
        f"({default['rounds']} rounds, one seed); "
        f"training memory exit 3 vs 12 at wav2vec 2.0 Base size: -{kws['saving_pct']:.1f}% "
        f"(tensors of one step, batch {memory['batch_size']}, 1-s clips) | Accuracy tables lost "
        f"from the paper's text; memory -{_row(memory, 'kws12', 'trained')['paper_saving_pct']}"
        "% (KWS) |"
    )


def render(results=RESULTS):
    """``({table name: markdown}, root README row)`` from the results files."""
    default = load("default.json", results)
    memory = load("memory_by_task.json", results)
    tables = {
        "results:superb-default": default_table(default, memory),
        "results:superb-table2": table2(load("table2_kws35.json", results)),
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
    """Write the five tables into ``readme`` and the row into ``root_readme``."""
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


def ingest_default(folder, machine, wall_s=None, results=RESULTS):
    """Copy what the tables read from a default run's ``results.json``; ``machine`` says where
    it ran, ``wall_s`` the seconds from launch to exit measured outside the process."""
    run = {**json.loads((Path(folder) / "results.json").read_text(encoding="utf-8")),
           "machine": machine, "wall_s": None if wall_s is None else float(wall_s)}  # fmt: skip
    keys = ("task", "scenario", "aggregation", "weighting", "rounds", "num_clients", "seed")
    extra = ("test", "memory_mb", "timings_s", "machine", "wall_s")
    keep = {k: run[k] for k in (*keys, *extra) if k in run}
    (Path(results) / "default.json").write_text(json.dumps(keep, indent=1) + "\n")


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


TABLE2_ARMS = {
    "homogeneous": "Homogeneous: every client at exit {deep}",
    "fedavg_full": "Heterogeneous 50/50 (exits 3 and {deep}), FedAvg over all layers",
    "layerwise": "Heterogeneous 50/50 (exits 3 and {deep}), layer-wise (n_i L_i)",
}
TABLE2_PAIRS = (("layerwise", "fedavg_full"), ("layerwise", "homogeneous"),
                ("fedavg_full", "homogeneous"))  # fmt: skip


def _runs_of(folders):
    """The ``results.json`` of comma-separated run folders (one per seed), folder attached."""
    runs = []
    for folder in folders.split(","):
        run = json.loads((Path(folder) / "results.json").read_text(encoding="utf-8"))
        runs.append({**run, "_folder": str(folder)})
    return runs


def paired_p(run_a, exit_a, run_b, exit_b, *, num_resamples=9999, seed=0):
    """Two-sided p of a paired sign-flip permutation test over (seed, speaker) units.

    H0: the two arms' correct-clip counts are exchangeable within each unit u. The statistic
    is ``sum_u (c^a_u - c^b_u)``; a permutation swaps the arms of random units
    (``scipy.stats.permutation_test``, ``permutation_type="samples"``).
    """
    from results_table import _unit_predictions
    from scipy.stats import permutation_test

    a, b = _unit_predictions(run_a, exit_a), _unit_predictions(run_b, exit_b)
    if a is None or b is None or set(a) != set(b):
        raise ValueError("paired_p needs per-clip predictions of the same test clips")
    units = sorted({unit for unit, _ in a.values()})
    index = {unit: i for i, unit in enumerate(units)}
    counts = np.zeros((2, len(units)))
    for key in a:
        counts[0, index[a[key][0]]] += a[key][1]
        counts[1, index[b[key][0]]] += b[key][1]
    result = permutation_test(
        (counts[0], counts[1]), lambda x, y, axis: np.sum(x - y, axis=axis),
        permutation_type="samples", vectorized=True, n_resamples=num_resamples,
        alternative="two-sided", random_state=seed,
    )  # fmt: skip
    return float(result.pvalue)


def ingest_table2(homogeneous, fedavg_full, layerwise, results=RESULTS):
    """Write ``table2_kws35.json``: the paper's Table 2 arms, one run folder per seed each.

    Each arm's accuracy at the deep exit (and exit 3 for the heterogeneous arms) is pooled
    over its seeds' test clips with a (seed, speaker) bootstrap CI; each pair of arms at the
    deep exit gets, over the seeds both arms ran, the paired difference
    (``results_table.paired_difference``) and the p of :func:`paired_p`.
    """
    from results_table import paired_difference, pooled_accuracy

    arms = {"homogeneous": _runs_of(homogeneous), "fedavg_full": _runs_of(fedavg_full),
            "layerwise": _runs_of(layerwise)}  # fmt: skip
    deep = max(int(e) for e in arms["homogeneous"][0]["test"])
    seeds = sorted({r["seed"] for runs in arms.values() for r in runs}, key=str)
    out = {"task": arms["homogeneous"][0]["task"], "seeds": seeds, "deep_exit": deep,
           "rounds": arms["homogeneous"][0]["rounds"], "arms": {}, "pairs": []}  # fmt: skip
    for name, runs in arms.items():
        exits = sorted(int(e) for e in runs[0]["test"])
        if max(exits) != deep or len({r["seed"] for r in runs}) != len(runs):
            raise ValueError(f"{name}: deep exit {max(exits)} (expected {deep}) or a seed twice")
        out["arms"][name] = {
            "aggregation": runs[0]["aggregation"], "scenario": runs[0]["scenario"],
            "seeds": [r["seed"] for r in runs],
            "per_seed": {str(e): [r["test"][str(e)]["accuracy"] for r in runs] for e in exits},
            "pooled": {str(e): pooled_accuracy(runs, str(e)) for e in exits},
        }  # fmt: skip
    for a, b in TABLE2_PAIRS:
        both = [s for s in out["arms"][a]["seeds"] if s in out["arms"][b]["seeds"]]
        if not both:
            raise ValueError(f"{a} and {b}: no seed in common, nothing to pair")
        run_a = [r for s in both for r in arms[a] if r["seed"] == s]
        run_b = [r for s in both for r in arms[b] if r["seed"] == s]
        value, (lo, hi) = paired_difference(run_a, str(deep), run_b, str(deep))
        p = paired_p(run_a, str(deep), run_b, str(deep))
        out["pairs"].append({"a": a, "b": b, "seeds": both, "difference": [value, lo, hi], "p": p})
    path = Path(results) / "table2_kws35.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def table2(data):
    """The paper's Table 2 on the default task: three arms, pooled over seeds, and the pairs."""
    deep, seeds = data["deep_exit"], data["seeds"]
    order = " / ".join(str(s) for s in seeds)
    lines = [f"| Set-up | Exit {deep} [95% CI] | Exit 3 [95% CI] | Exit {deep}, seeds {order} |",
             "|---|---|---|---|"]  # fmt: skip
    for name, label in TABLE2_ARMS.items():
        arm = data["arms"][name]
        cells = []
        for e in (str(deep), "3"):
            pooled = arm["pooled"].get(e)
            cells.append("-" if pooled is None else _ci({"accuracy": pooled[0], "ci95": pooled[1]}))
        by_seed = dict(zip(arm["seeds"], arm["per_seed"][str(deep)], strict=True))
        per_seed = " / ".join(f"{by_seed[s]:.3f}" if s in by_seed else "-" for s in seeds)
        lines.append(f"| {label.format(deep=deep)} | {cells[0]} | {cells[1]} | {per_seed} |")
    lines += ["", f"| Exit {deep}: difference | Seeds | Paired [95% CI] | p |", "|---|---|---|---|"]
    names = {"homogeneous": "homogeneous", "fedavg_full": "FedAvg", "layerwise": "layer-wise"}
    for pair in data["pairs"]:
        value, lo, hi = pair["difference"]
        p = "< 0.001" if pair["p"] < 0.001 else f"{pair['p']:.3f}"
        lines.append(f"| {names[pair['a']]} - {names[pair['b']]} | "
                     f"{', '.join(str(s) for s in pair['seeds'])} | {value:+.3f} "
                     f"[{lo:+.3f}, {hi:+.3f}] | {p} |")  # fmt: skip
    target = next(p for p in data["pairs"] if (p["a"], p["b"]) == ("layerwise", "fedavg_full"))
    met = target["difference"][1] > 0 and target["p"] < 0.05
    lines += [
        "",
        f"{data['rounds']} rounds. Target (layer-wise significantly above "
        f"heterogeneous FedAvg at exit {deep}, paired): " + ("met." if met else "not met."),
    ]
    return "\n".join(lines)


def main(argv=None):
    """Write the tables (default), check them, or ingest a run first."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a README differs")
    parser.add_argument("--ingest_default", nargs="+", default=None,
                        metavar="RUN MACHINE [WALL_S]",
                        help="a default run's output folder, where it ran, its wall seconds")  # fmt: skip
    parser.add_argument("--ingest_depth", nargs=3, default=None,
                        metavar=("LABEL", "SHALLOW_RUNS", "DEEP_RUNS"))  # fmt: skip
    parser.add_argument("--ingest_table2", nargs=3, default=None,
                        metavar=("HOMOGENEOUS_RUNS", "FEDAVG_RUNS", "LAYERWISE_RUNS"))  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        stale = differences()
        if stale:
            print("out of date with the results files:", ", ".join(stale))
            return 1
        return 0
    if args.ingest_default:
        ingest_default(*args.ingest_default)
    if args.ingest_depth:
        ingest_depth(*args.ingest_depth)
    if args.ingest_table2:
        ingest_table2(*args.ingest_table2)
    write()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())

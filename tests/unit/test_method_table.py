"""recipes/MLS/studies/method_table.py: table formatting, README insertion, skipping, on synthetic runs.

The 14 real runs take about an hour of CPU; here every run folder holds a hand-written
``results.json`` (the shape train_fl.py writes), so the script's own ``main`` skips them all
and only collects, formats and inserts.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "MLS" / "studies" / "method_table.py"
_spec = importlib.util.spec_from_file_location("method_table", SCRIPT)
method_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(method_table)

# (method, variant) -> (WER, epsilon, sigma_eff encoder, sigma_eff llm)
RUNS = {
    ("fedavg", "frozen"): (0.30, None, None, None),
    ("fedavg", "unfrozen"): (0.28, None, None, None),
    ("flat", "frozen"): (0.35, 614.1, None, 0.1),
    ("flat", "unfrozen"): (0.33, 614.1, 0.1, 0.1),
    ("alpha_split", "frozen"): (0.36, 614.1, None, 0.1026),
    ("alpha_split", "unfrozen"): (0.50, 614.1, 0.4472, 0.1026),
}
ROUND0 = 0.45


def _results(method, variant, wer, epsilon, sig_enc, sig_llm):
    sigma = {k: v for k, v in (("encoder", sig_enc), ("llm", sig_llm)) if v is not None}
    return {
        "method": method,
        "model": "tiny",
        "freeze_encoder": variant == "frozen",
        "num_clients": 32,
        "test": {"WER": wer, "WER_ci95": [wer - 0.02, wer + 0.03], "per_language": {}},
        "test_round0": {"WER": ROUND0, "WER_ci95": [0.41, 0.49]},
        # The paired bootstrap of final - round 0 (only FedAvg unfrozen clears it here).
        "test_change_from_round0": {
            "difference": wer - ROUND0,
            "ci95": [wer - ROUND0 - 0.05, wer - ROUND0 + 0.05],
            "significant": (method, variant) == ("fedavg", "unfrozen"),
        },
        "privacy": {
            "epsilon": epsilon,
            "delta": None if epsilon is None else 1e-5,
            "noise_multiplier": 0.0 if epsilon is None else 0.1,
            "clip": None if epsilon is None else 1.0,
            "sampling_rate": 0.3,
            "rounds": 12,
            "sigma_eff": sigma,
        },
        "data": {"embedded_corpus": True},
        "stopped_early": False,
        "timings_s": {"total": 300.0},
    }


@pytest.fixture
def root(tmp_path):
    out = tmp_path / "runs"
    for (method, variant), values in RUNS.items():
        folder = method_table.run_folder(out, method, variant)
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(_results(method, variant, *values)))
    return out


def _row(table, name):
    rows = [line for line in table.splitlines() if line.startswith(f"| {name} |")]
    assert len(rows) == 1, table
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_table_cells(root):
    table = method_table.format_method_table(method_table.load_results(root))
    assert table.splitlines()[0] == method_table.HEADER
    assert _row(table, "FedAvg (no DP)") == [
        "FedAvg (no DP)", "0.3000 [0.2800, 0.3300]", "—", "0.2800 [0.2600, 0.3100] §", "—", "-",
        "-",
    ]  # fmt: skip
    # Gap against the FedAvg run of the same variant; sigma_eff from the unfrozen run.
    assert _row(table, "Flat") == [
        "Flat", "0.3500 [0.3300, 0.3800]", "+0.0500", "0.3300 [0.3100, 0.3600]", "+0.0500",
        "614.1", "0.100 / 0.100",
    ]  # fmt: skip
    # WER not below round 0 (0.50 >= 0.45) is marked with a dagger.
    assert _row(table, "α-Split") == [
        "α-Split", "0.3600 [0.3400, 0.3900]", "+0.0600", "0.5000 [0.4800, 0.5300] †", "+0.2200",
        "614.1", "0.447 / 0.103",
    ]  # fmt: skip
    # Methods without any run are left out; rows follow the paper's order.
    assert "PFL-Dim" not in table
    names = [line.split("|")[1].strip() for line in table.splitlines()[2:5]]
    assert names == ["FedAvg (no DP)", "Flat", "α-Split"]
    assert "WER 0.4500 [0.4100, 0.4900]." in table
    assert "K=32 clients, T=12 rounds, q=0.3, C=1.0, sigma=0.1, delta=1e-05" in table
    assert "model tiny on the embedded espeak-ng corpus, K=32" in table
    assert "delta=1e-05; 6 runs, 30 min of run time in all." in table


def test_missing_baseline_and_variant(root):
    results = method_table.load_results(root)
    del results[("fedavg", "unfrozen")]
    del results[("flat", "frozen")]
    table = method_table.format_method_table(results)
    flat = _row(table, "Flat")
    assert flat[1:3] == ["-", "-"]  # no frozen run
    assert flat[4] == "-"  # no unfrozen FedAvg to take the gap against
    assert _row(table, "α-Split")[2] == "+0.0600"


def test_epsilon_differs_between_variants(root):
    results = method_table.load_results(root)
    results[("flat", "unfrozen")]["privacy"]["epsilon"] = 500.0
    results[("flat", "unfrozen")]["stopped_early"] = True
    row = _row(method_table.format_method_table(results), "Flat")
    assert row[5] == "614.1 / 500"
    assert row[3].endswith("‡")


def test_insert_creates_then_replaces_end_marker():
    text = (
        "# Results\n\n## Results on the embedded corpus\n\n<!-- method-table:start -->\n\nAfter.\n"
    )
    once = method_table.insert_table(text, "| a |\n")
    assert once == (
        "# Results\n\n## Results on the embedded corpus\n\n<!-- method-table:start -->\n| a |\n"
        "<!-- method-table:end -->\n\nAfter.\n"
    )
    twice = method_table.insert_table(once, "| b |")
    assert twice == once.replace("| a |", "| b |")
    assert method_table.insert_table(twice, "| b |") == twice  # idempotent


def test_insert_errors():
    with pytest.raises(ValueError, match="no <!-- method-table:start --> marker"):
        method_table.insert_table("nothing here", "| a |")
    with pytest.raises(ValueError, match="comes before"):
        method_table.insert_table("<!-- method-table:end -->\n<!-- method-table:start -->", "| a |")


def test_update_readme_names_the_file(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no marker")
    with pytest.raises(ValueError, match="README.md: no <!-- method-table:start -->"):
        method_table.update_readme(readme, "| a |")


def test_main_skips_existing_runs_and_writes_table(root, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("Intro\n<!-- method-table:start -->\nTail\n")
    table_file = tmp_path / "out" / "method_table.md"
    code = method_table.main(
        [
            "--methods", "fedavg,flat", "alpha_split",
            "--output-root", str(root),
            "--table-file", str(table_file),
            "--readme", str(readme),
            "--private-epsilon", "0",
            "--number_of_rounds", "3",
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 6 and "$ " not in out  # nothing was run
    assert not (table_file.parent / "method_table_dev_wer.png").exists()  # no rounds.csv
    table = table_file.read_text()
    assert table.startswith(method_table.HEADER)
    text = readme.read_text()
    assert text.startswith("Intro\n<!-- method-table:start -->\n" + method_table.HEADER)
    assert text.endswith("<!-- method-table:end -->\nTail\n")


def test_main_leaves_readme_alone_for_real_data(root, tmp_path, capsys):
    path = method_table.run_folder(root, "flat", "frozen") / "results.json"
    results = json.loads(path.read_text())
    results["data"]["embedded_corpus"] = False
    path.write_text(json.dumps(results))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- method-table:start -->\n")
    args = ["--table-only", "--output-root", str(root), "--readme", str(readme)]
    args += ["--table-file", str(tmp_path / "t.md")]
    assert method_table.main(args) == 0
    assert readme.read_text() == "<!-- method-table:start -->\n"
    assert "mixed corpora" in (tmp_path / "t.md").read_text()


def test_dry_run_prints_commands(tmp_path, capsys):
    args = ["--dry-run", "--methods", "pfl_dim", "--output-root", str(tmp_path / "r")]
    assert method_table.main([*args, "--cache-folder", "c", "--number_of_rounds", "3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "$ " in line]
    assert len(lines) == 2
    assert "pfl_dim.yaml --freeze_encoder True --output_folder" in lines[0]
    assert lines[1].endswith(
        f"--freeze_encoder False --output_folder {tmp_path}/r/pfl_dim/freeze_encoder_False "
        "--cache_folder c --number_of_rounds 3"
    )
    assert lines[0].split(" $ ")[1].split()[:2] == [
        sys.executable,
        str(SCRIPT.parents[1] / "train_fl.py"),
    ]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="--output_folder is set by method_table.py"):
        method_table.train_command(
            method="flat",
            variant="frozen",
            output_root="r",
            cache_folder="c",
            extra=["--output_folder", "x"],
        )
    with pytest.raises(SystemExit, match="unknown \\['flatt'\\]"):
        method_table.main(["--methods", "flatt", "--dry-run"])
    with pytest.raises(SystemExit, match="--variants"):
        method_table.main(["--variants", "frozen,half", "--dry-run"])
    bad = method_table.run_folder(tmp_path, "flat", "frozen")
    bad.mkdir(parents=True)
    (bad / "results.json").write_text('{"test": {}}')
    with pytest.raises(ValueError, match="results.json: no test.WER"):
        method_table.load_results(tmp_path)


def test_sigma_for_epsilon_stays_at_or_below_the_target():
    from speechbrain_fl.privacy.accounting import compute_epsilon

    sigma = method_table.sigma_for_epsilon(
        sampling_rate=0.3, rounds=10, delta=1e-5, target_epsilon=10.0
    )
    eps = compute_epsilon(sampling_rate=0.3, noise_multiplier=sigma, rounds=10, delta=1e-5)
    assert eps <= 10.0
    assert (
        compute_epsilon(sampling_rate=0.3, noise_multiplier=sigma - 0.01, rounds=10, delta=1e-5)
        > 10.0 - 1.0
    )  # not wastefully large


def _with_ratio(results, ratio, *, sigma_source="this run"):
    results["noise_vs_update"] = {
        "noise_norm": ratio * 0.5, "mean_update_norm": 0.5, "ratio": ratio,
        "sigma_source": sigma_source, "trainable_values": 55504, "expected_cohort_size": 38.4,
        "norm_profile": {"llm_encoder_ratio": 0.4},
    }  # fmt: skip
    return results


def test_change_table(root):
    results = method_table.load_results(root)
    _with_ratio(results[("fedavg", "unfrozen")], 0.8, sigma_source="paper (no noise)")
    results[("fedavg", "unfrozen")]["pools"] = {
        "ratio_per_matrix": 11.0, "ratio_per_coordinate": 9.77,
        "retention": {"encoder": 1.0, "llm": 0.62},
    }  # fmt: skip
    table = method_table.format_change_table(results)
    row = _row(table, "FedAvg (no DP) | unfrozen")
    assert row[2] == "-0.1700 [-0.2200, -0.1200] (-38%)"
    assert row[3] == "0.4 / 0.5 = 0.80 (σ 0.1)"
    assert row[4:] == ["11.00x", "9.77x", "1.00 / 0.62"]
    assert _row(table, "Flat | frozen")[3:] == ["-", "-", "-", "-"]


def test_private_table_extrapolates_to_larger_populations(root):
    results = method_table.load_results(root)
    run = _with_ratio(results[("alpha_split", "unfrozen")], 10.0)
    run["privacy"].update(noise_multiplier=0.87, epsilon=9.9, delta=1e-5, rounds=10, clip=1.0)
    table = method_table.format_private_table(
        {("alpha_split", "unfrozen"): run}, target_epsilon=10.0
    )
    row = _row(table, "α-Split | unfrozen")
    assert row[2:4] == ["0.87", "9.90"]
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if "|" in line}
    populations = [k for k in lines if k.replace(",", "").isdigit()]
    assert populations == ["128", "316", "10,000"]
    # same q and sigma: same epsilon at every population; noise std sigma C / n
    assert "| 95 | 9.16e-03 |" in lines["316"] and "| 3,000 | 2.90e-04 |" in lines["10,000"]


def test_dev_wer_figure_from_rounds(root, tmp_path):
    for method, variant in [("fedavg", "unfrozen"), ("alpha_split", "unfrozen")]:
        folder = method_table.run_folder(root, method, variant)
        (folder / "rounds.csv").write_text("round,WER\n0,0.5\n3,0.45\n")
    path = method_table.write_dev_wer_figure({"σ 0.1": root}, tmp_path / "f" / "w.png")
    assert path.is_file() and path.stat().st_size > 1000
    assert method_table.write_dev_wer_figure({"x": tmp_path / "none"}, tmp_path / "n.png") is None


def test_run_side_by_side_bounds_concurrency_and_reports_failures(tmp_path):
    # real subprocesses: each records when it ran and its thread setting, one fails
    script = (
        "import os, sys, time; t = time.time(); time.sleep(0.6); "
        "open(sys.argv[1], 'w').write(f\"{t} {time.time()} {os.environ['OMP_NUM_THREADS']}\"); "
        "sys.exit(int(sys.argv[2]))"
    )
    todo = [
        (f"run{i}, v", tmp_path / f"run{i}", [sys.executable, "-c", script,
                                             str(tmp_path / f"t{i}"), "3" if i == 2 else "0"])
        for i in range(4)
    ]  # fmt: skip
    failed = []
    method_table.run_side_by_side(todo, jobs=2, failed=failed)
    spans = [tuple(map(float, (tmp_path / f"t{i}").read_text().split()[:2])) for i in range(4)]
    assert all((tmp_path / f"t{i}").read_text().split()[2] == "1" for i in range(4))
    for start, _ in spans:  # at most 2 runs alive at any start
        assert sum(s <= start < e for s, e in spans) <= 2
    assert len(failed) == 1 and failed[0].startswith("run2/v (exit 3;")
    assert (tmp_path / "run2" / "stdout.txt").is_file()


def test_jobs_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        method_table.parse_args(["--jobs", "0"])


def _seed_run(root, method, seed, *, wer, round0=0.6, n=120, llm_retention=None):
    """A run folder at <root>/seed<seed>/<method>/freeze_encoder_False with details CSVs."""
    import numpy as np

    from speechbrain_fl.metrics import UtteranceErrors, write_utterance_details

    folder = method_table.run_folder(root / f"seed{seed}", method, "unfrozen")
    folder.mkdir(parents=True)
    ids = tuple(f"u{i:03d}" for i in range(n))
    speakers = tuple(f"s{i % 24:02d}" for i in range(n))
    refs = np.full(n, 10)
    rng = np.random.default_rng(seed)
    for name, rate in (("test_utterances.csv", wer), ("test_utterances_round0.csv", round0)):
        edits = rng.binomial(refs, rate)
        write_utterance_details(folder / name, UtteranceErrors(ids, speakers, ("",) * n,
                                                               edits, refs))  # fmt: skip
    results = _results(method, "unfrozen", wer, None if method == "fedavg" else 530.0, 0.1, 0.1)
    results["pools"] = {"ratio_per_coordinate": 7.0,
                        "retention": {"encoder": 0.9, "llm": llm_retention or 0.5}}  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_seeds_table_pools_runs_and_pairs_methods(tmp_path):
    """--seeds --table-only: per method the seeds' WERs, the pooled change from round 0, the
    LLM retention against Flat's, and paired seed-pooled comparisons (a clear gap significant)."""
    root = tmp_path / "runs"
    for seed in (1, 2, 3):
        _seed_run(root, "fedavg", seed, wer=0.30, llm_retention=1.0)
        _seed_run(root, "flat", seed, wer=0.35, llm_retention=0.8)
        _seed_run(root, "pfl_uniform", seed, wer=0.55, llm_retention=0.4)
    table_file = tmp_path / "table.md"
    code = method_table.main(["--seeds", "1", "2", "3", "--table-only", "--no-readme",
                              "--variants", "unfrozen", "--output-root", str(root),
                              "--table-file", str(table_file), "--private-epsilon", "0"])  # fmt: skip
    assert code == 0
    table = table_file.read_text()
    methods, pairs = table.split("Paired comparisons", 1)
    row = _row(methods, "PFL-Uniform")
    assert row[1] == "3" and len(row[2].split(" / ")) == 3
    assert row[7] == "0.50x"  # 0.4 / 0.8
    assert "§" in _row(methods, "FedAvg (no DP)")[4]
    pair = _row(pairs, "PFL-Uniform | Flat")
    assert pair[2] == "3" and pair[-1] == "yes" and float(pair[5].split()[0]) > 0.1
    assert "Per run at seed 1" in table


def test_seeds_table_pairs_alpha_split_with_pfl_dim(tmp_path):
    """The frozen-encoder null pair (alpha-split runs as PFL-Dim there) is in the comparisons."""
    from seed_table import collect, comparisons

    root = tmp_path / "runs"
    for seed in (1, 2):
        _seed_run(root, "pfl_dim", seed, wer=0.40, n=48)
        _seed_run(root, "alpha_split", seed, wer=0.40, n=48)
    done = collect({
        m: [method_table.run_folder(root / f"seed{s}", m, "unfrozen") for s in (1, 2)]
        for m in ("pfl_dim", "alpha_split")
    })  # fmt: skip
    pairs = comparisons(done, num_resamples=200)
    assert [(p["a"], p["b"], p["seeds"]) for p in pairs] == [("alpha_split", "pfl_dim", 2)]

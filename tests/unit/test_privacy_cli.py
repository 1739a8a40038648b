"""The ``speechbrain-fl`` console script, via subprocess and via ``main([...])``."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from speechbrain_fl.cli import main
from speechbrain_fl.privacy import compute_epsilon

LAYOUT = Path(__file__).resolve().parents[2] / "docs" / "examples" / "whisper_tinyllama_layout.json"


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "speechbrain_fl.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_budgets_json_subprocess_exact_schema():
    proc = run_cli(
        "budgets",
        "--layout",
        str(LAYOUT),
        "--method",
        "alpha_split",
        "--alpha",
        "0.05",
        "--noise-multiplier",
        "0.1",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"method", "clip", "groups", "components"}
    assert out["method"] == "alpha_split" and out["clip"] == 1.0
    assert len(out["groups"]) == 110
    assert set(out["groups"][0]) == {"name", "component", "numel", "budget"}
    assert all(set(v) == {"budget", "sigma_eff"} for v in out["components"].values())
    assert out["components"]["encoder"]["budget"] == pytest.approx(math.sqrt(0.05))
    assert out["components"]["encoder"]["sigma_eff"] == pytest.approx(0.1 / math.sqrt(0.05))
    total = math.sqrt(sum(g["budget"] ** 2 for g in out["groups"]))
    assert total == pytest.approx(1.0, rel=1e-9)


def test_budgets_table_via_main(capsys):
    assert main(["budgets", "--layout", str(LAYOUT), "--method", "pfl_dim", "--clip", "2"]) == 0
    text = capsys.readouterr().out
    assert "method pfl_dim" in text and "encoder" in text and "connector.proj.bias" in text
    # title, blank, component header, 3 components, blank, group header, 110 groups
    assert len(text.splitlines()) == 3 + 3 + 2 + 110


def test_budgets_flat_json(capsys):
    main(["budgets", "--layout", str(LAYOUT), "--method", "flat", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert {g["budget"] for g in out["groups"]} == {1.0}
    assert {v["sigma_eff"] for v in out["components"].values()} == {1.0}


def test_privacy_subprocess_and_main(capsys):
    args = [
        "privacy",
        "--sampling-rate",
        "0.04",
        "--noise-multiplier",
        "1.5",
        "--rounds",
        "2250",
        "--delta",
        "1e-5",
        "--json",
    ]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # PLD by default, Opacus's published RDP figure beside it
    assert out["accountant"] == "pld" and out["delta"] == 1e-5
    assert out["epsilon_rdp"] == pytest.approx(7.32911117143, abs=5e-8)
    assert out["epsilon"] == compute_epsilon(
        sampling_rate=0.04, noise_multiplier=1.5, rounds=2250, delta=1e-5, accountant="pld"
    )
    assert 0.85 * out["epsilon_rdp"] < out["epsilon"] < out["epsilon_rdp"]
    rdp = json.loads(run_cli(*args, "--accountant", "rdp").stdout)
    assert rdp["accountant"] == "rdp" and rdp["epsilon"] == out["epsilon_rdp"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == out["epsilon"]


def test_privacy_inverse(capsys):
    main(
        [
            "privacy",
            "--sampling-rate",
            "0.04",
            "--epsilon",
            "8",
            "--rounds",
            "2000",
            "--delta",
            "1e-5",
            "--json",
            "--accountant",
            "rdp",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(1.3562, abs=5e-5)
    assert out["epsilon"] <= 8.0
    assert out["epsilon"] == compute_epsilon(
        sampling_rate=0.04,
        noise_multiplier=out["noise_multiplier"],
        rounds=2000,
        delta=1e-5,
        accountant="rdp",
    )


def test_privacy_reports_large_epsilon_warning(capsys):
    main(
        [
            "privacy",
            "--sampling-rate",
            "0.3",
            "--noise-multiplier",
            "0.5",
            "--rounds",
            "40",
            "--delta",
            "1e-5",
        ]
    )
    assert "exceeds 10" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ["budgets", "--layout", "missing.json", "--method", "flat"],
            "file not found: missing.json",
        ),
        (["budgets", "--layout", "{bad}", "--method", "magic"], "invalid choice: 'magic'"),
        (
            ["budgets", "--layout", "{layout}", "--method", "alpha_split", "--alpha", "1.5"],
            "between 0 and 1",
        ),
        (["budgets", "--layout", "{layout}", "--method", "alpha_split"], "needs alpha"),
        (["budgets", "--layout", "{layout}", "--method", "pfl_dim", "--clip", "-1"], "positive"),
        (["budgets", "--layout", "{bad}", "--method", "flat"], "bad.json is not valid JSON"),
        (
            [
                "privacy",
                "--sampling-rate",
                "2",
                "--noise-multiplier",
                "1",
                "--rounds",
                "3",
                "--delta",
                "1e-5",
            ],
            "sampling_rate",
        ),
        (
            [
                "privacy",
                "--sampling-rate",
                "0.1",
                "--noise-multiplier",
                "-1",
                "--rounds",
                "3",
                "--delta",
                "1e-5",
            ],
            "noise_multiplier",
        ),
        (
            ["privacy", "--sampling-rate", "0.1", "--rounds", "3", "--delta", "1e-5"],
            "one of the arguments --noise-multiplier --epsilon is required",
        ),
    ],
)
def test_bad_input_is_an_argparse_error(tmp_path, capsys, args, match):
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    args = [a.replace("{bad}", str(bad)).replace("{layout}", str(LAYOUT)) for a in args]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_bad_json_subprocess(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    proc = run_cli("budgets", "--layout", str(bad), "--method", "flat")
    assert proc.returncode == 2 and "bad.json is not valid JSON" in proc.stderr

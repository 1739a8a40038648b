"""Adaptive clipping end to end on the toy task: local backend, alpha-split pools, SecAgg+, Ray.

``clip: 0.05`` is below every toy update's norm, so every client is clipped, the noisy unclipped
fraction is near 0 and the clip must grow round after round. ``seed``, ``noise_seed`` and
``sampler_seed`` are fixed for the tests only; with the same seeds a SecAgg+ run and a central
run train the same updates and draw the same count noise, so their released fractions agree.
"""

from __future__ import annotations

import csv
import functools
import math

import pytest
from flwr.app import Context, RecordDict

from speechbrain_fl.fl.clientapp.train import make_client_app
from speechbrain_fl.fl.engines.local_grid import LocalGrid
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings
from speechbrain_fl.privacy import Group, Layout, compute_epsilon

from .test_secagg_local import RecordingGrid

SETTINGS = {"num_partitions": 6, "number_of_rounds": 3, "seed": 0, "eval_every": 0,
            "method": "flat", "clip": 0.05, "noise_multiplier": 0.5, "clip_quantile": 0.5,
            "clip_quantile_lr": 0.2, "clip_count_stddev": 1.0, "min_clients": 1,
            "noise_seed": 5, "sampler_seed": 6}  # fmt: skip
#: the toy Linear(4, 1) split into the two alpha-split pools
POOLED = Layout([Group("model.weight", "encoder", 4), Group("model.bias", "llm", 1)])


def _pooled_client(context, settings):
    task = toy_client(context, settings)
    task.layout = POOLED
    return task


def _pooled_server(context, settings):
    task = toy_server(context, settings)
    task.layout = POOLED
    return task


def _run(tmp_path, name, *, pooled=False, grid_class=None, **extra):
    settings = toy_settings(None, {**SETTINGS, **extra, "output_folder": str(tmp_path / name)})
    client = _pooled_client if pooled else toy_client
    server = _pooled_server if pooled else toy_server
    app = make_client_app(functools.partial(client, settings=settings))
    grid = (grid_class or RecordingGrid)(LocalGrid(app, num_nodes=settings["num_partitions"]))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with grid.identity():
        result = run_server(grid, server(context, settings))
    with open(tmp_path / name / "rounds.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["round"] != "0"]
    return result, rows, grid


def _check_trajectory(result, rows, pools):
    """rounds.csv and results.json carry the same clips, moved by the released fractions."""
    adaptive = result.privacy["adaptive_clipping"]
    assert len(adaptive["rounds"]) == len(rows) == SETTINGS["number_of_rounds"]
    for row, entry in zip(rows, adaptive["rounds"], strict=True):
        for pool in pools:
            assert float(row[f"clip_{pool}"]) == pytest.approx(entry[f"clip_{pool}"])
        assert float(row["clip"]) == pytest.approx(entry["clip"])
    after = [{p: float(r[f"clip_{p}"]) for p in pools} for r in rows[1:]]
    after.append(adaptive["final_clips"])
    for row, clips in zip(rows, after, strict=True):
        for pool in pools:
            step = math.exp(-0.2 * (float(row[f"unclipped_{pool}"]) - 0.5))
            assert clips[pool] == pytest.approx(float(row[f"clip_{pool}"]) * step)


def test_flat_adaptive_clip_grows_when_every_client_is_clipped(tmp_path):
    result, rows, _ = _run(tmp_path, "flat")
    _check_trajectory(result, rows, ["all"])
    clips = [float(r["clip_all"]) for r in rows]
    assert clips[0] == 0.05 and clips[0] < clips[1] < clips[2]
    assert all(float(r["clip_rate"]) == 1.0 for r in rows)
    assert [float(r["budget_all"]) for r in rows] == pytest.approx(clips)  # the round's budget
    # the guarantee: the accountant at the YAML z, which update and count spend together
    expected = compute_epsilon(sampling_rate=1.0, noise_multiplier=0.5, rounds=3, delta=1e-5)
    assert result.privacy["epsilon"] == pytest.approx(expected)
    sigma = result.privacy["adaptive_clipping"]["update_noise_multiplier"]
    assert sigma**-2 + 2.0**-2 == pytest.approx(0.5**-2)  # z_b = 2 sigma_b = 2
    for row, clip in zip(rows, clips, strict=True):  # the update's noise on the round's C_t
        assert float(row["noise_std"]) == pytest.approx(sigma * clip / 6)


def test_alpha_split_adapts_one_clip_per_pool(tmp_path):
    result, rows, grid = _run(tmp_path, "alpha", pooled=True, method="alpha_split", alpha=0.5,
                              clip_count_stddev=2.0)  # fmt: skip
    _check_trajectory(result, rows, ["encoder", "llm"])
    for row in rows:  # alpha_t = C_enc^2 / C_t^2 through the budgets of the round
        assert float(row["budget_encoder"]) == pytest.approx(float(row["clip_encoder"]))
        assert float(row["budget_llm"]) == pytest.approx(float(row["clip_llm"]))
    trained = [r.content["metrics"] for r in grid.replies if "arrays" in r.content]
    assert len(trained) == 6 * 3  # every client every round (q = 1), each with its two bits
    assert all(len(m["clip-bits"]) == 2 and set(m["clip-bits"]) <= {0.0, 1.0} for m in trained)
    sigma = result.privacy["adaptive_clipping"]["update_noise_multiplier"]
    z_b = 2 * 2.0 / math.sqrt(2)  # two bits per client: sensitivity sqrt(2) / 2
    assert sigma**-2 + z_b**-2 == pytest.approx(0.5**-2)
    assert set(result.privacy["sigma_eff"]) == {"encoder", "llm"}
    assert min(result.privacy["sigma_eff"].values()) >= sigma * (1 - 1e-9)


def test_secaggplus_sums_the_bits_securely(tmp_path):
    central, central_rows, _ = _run(tmp_path, "central", number_of_rounds=1)
    secure, secure_rows, grid = _run(tmp_path, "secure", number_of_rounds=1,
                                     secure_aggregation="secaggplus")  # fmt: skip
    # the same updates and count noise: the count from the secure sum is the central one
    assert float(secure_rows[0]["unclipped_all"]) == pytest.approx(
        float(central_rows[0]["unclipped_all"]), abs=1e-12
    )
    assert secure.privacy["adaptive_clipping"]["final_clips"] == pytest.approx(
        central.privacy["adaptive_clipping"]["final_clips"]
    )
    for reply in grid.replies:  # no bit reaches the server in the clear
        for record in reply.content.metric_records.values():
            assert "clip-bits" not in record
        for record in reply.content.config_records.values():
            assert not any("clip-bits" in str(k) for k in record)


@pytest.mark.slow
def test_ray_engine_gives_the_local_backends_trajectory(tmp_path):
    from speechbrain_fl.fl import TaskSpec, run_simulation

    files = {}
    for backend in ("local", "ray"):
        out = tmp_path / backend
        spec = TaskSpec("speechbrain_fl.fl.toy:toy_task", None,
                        {**SETTINGS, "output_folder": str(out)})  # fmt: skip
        run_simulation(
            spec, backend=backend, client_resources={"num_cpus": 1}, ray_init_args={"num_cpus": 2}
        )
        files[backend] = (out / "rounds.csv").read_text()
    assert "clip_all" in files["local"].splitlines()[0]
    assert files["local"] == files["ray"]


class _BadBitsGrid(RecordingGrid):
    """Replaces the bits of partition 0's replies by a value that is not a bit."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            metrics = reply.content.metric_records.get("metrics")
            if metrics is not None and "clip-bits" in metrics and metrics["partition-id"] == 0:
                metrics["clip-bits"] = [0.5]
        return replies


def test_reply_without_valid_bits_is_dropped(tmp_path):
    result, rows, _ = _run(tmp_path, "bad", number_of_rounds=2, grid_class=_BadBitsGrid)
    assert [int(r["dropped_replies"]) for r in rows] == [1, 1]
    assert [int(r["num_replied"]) for r in rows] == [5, 5]
    assert len(result.privacy["adaptive_clipping"]["rounds"]) == 2


def test_resume_continues_from_the_clips_reached(tmp_path):
    first, _, _ = _run(tmp_path, "run", number_of_rounds=2)
    reached = first.privacy["adaptive_clipping"]["final_clips"]["all"]
    resumed, rows, _ = _run(tmp_path, "run", number_of_rounds=3)
    rounds = resumed.privacy["adaptive_clipping"]["rounds"]
    assert len(rounds) == len(rows) == 3
    assert rounds[2]["clip"] == pytest.approx(reached)
    with pytest.raises(ValueError, match="clip_quantile"):
        _run(tmp_path, "run", number_of_rounds=4, clip_quantile=0.6)


def test_flat_over_several_components_records_its_clips(tmp_path):
    """A flat clip over two components records no component budget: the clips per round come
    from rounds.csv, and every pool's sigma_eff is the update's sigma_Delta."""
    result, rows, _ = _run(tmp_path, "flat2", pooled=True)
    _check_trajectory(result, rows, ["all"])
    sigma = result.privacy["adaptive_clipping"]["update_noise_multiplier"]
    assert result.privacy["sigma_eff"] == pytest.approx({"encoder": sigma, "llm": sigma})

"""SecAgg+ runs on the local backend: the server holds only masked vectors and the sum.

The toy task's clients train for one round with and without ``secure_aggregation``, from the
same seeds (non-private, clipped, uniform mean: the aggregates are comparable without noise);
every message the ServerApp receives is recorded. ``seed``, ``noise_seed`` and ``sampler_seed``
are fixed for the test only.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from speechbrain_fl.fl.clientapp.train import make_client_app
from speechbrain_fl.fl.engines.local_grid import LocalGrid
from speechbrain_fl.fl.serverapp.main import run_server
from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings
from speechbrain_fl.privacy import compute_epsilon

from .test_fl_local_backend import failing_client

CLIP = 0.05  # below the toy updates' norms: every client is clipped
SETTINGS = {"num_partitions": 4, "number_of_rounds": 1, "seed": 0, "eval_every": 0,
            "method": "flat", "clip": CLIP, "noise_multiplier": 0.0, "aggregation": "uniform",
            "min_clients": 1}  # fmt: skip


class RecordingGrid:
    """A Grid that keeps every reply the ServerApp gets (what the server holds)."""

    def __init__(self, grid):
        self._grid, self.replies = grid, []

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.replies.extend(replies)
        return replies


def _run(tmp_path, name, *, client=toy_client, **extra):
    settings = toy_settings(None, {**SETTINGS, **extra, "output_folder": str(tmp_path / name)})
    grid = RecordingGrid(LocalGrid(make_client_app(functools.partial(client, settings=settings)),
                                   num_nodes=settings["num_partitions"]))  # fmt: skip
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with grid.identity():
        result = run_server(grid, toy_server(context, settings))
    return result, grid


def _plain_updates(grid):
    """Each client's clipped update in a run without secure aggregation, by node."""
    out = {}
    for reply in grid.replies:
        if "arrays" in reply.content.array_records:
            arrays = reply.content["arrays"].to_torch_state_dict()
            out[int(reply.content["metrics"]["partition-id"])] = arrays
    return out


def _masked_vectors(grid):
    out = []
    for reply in grid.replies:
        record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if record is not None and Key.MASKED_PARAMETERS in record:
            out.append([bytes_to_ndarray(b) for b in record[Key.MASKED_PARAMETERS]])
    return out


def test_server_holds_only_masked_vectors_and_unmasks_the_sum(tmp_path):
    plain, plain_grid = _run(tmp_path, "plain")
    secure, secure_grid = _run(tmp_path, "secure", secure_aggregation="secaggplus")
    # nothing the ServerApp received carries a tensor: no ArrayRecord holds data
    for reply in secure_grid.replies:
        assert not reply.has_error()
        assert all(len(record) == 0 for record in reply.content.array_records.values())
        for metrics in reply.content.config_records.values():
            assert "group-norms" not in metrics and "train-loss" not in metrics
    masked = _masked_vectors(secure_grid)
    assert len(masked) == SETTINGS["num_partitions"]
    # each masked vector is uniform in Z_2^32, not the client's encoded update
    updates = _plain_updates(plain_grid)
    for vector in masked:
        values = np.concatenate([a.ravel() for a in vector[1:]]).astype(np.int64)
        for update in updates.values():
            flat = np.concatenate([u.double().numpy().ravel() for u in update.values()])
            plain_code = (flat + CLIP) * 2**24 / (2 * CLIP)
            assert np.mean(np.abs(values - plain_code) < 2**20) < 0.5
    # the unmasked mean is the plaintext mean, within the encoding's rounding bound
    step = 2 * CLIP / 2**24
    total = sum(v.numel() for v in plain.params.values())
    for name, value in plain.params.items():
        assert torch.allclose(secure.params[name], value, atol=2 * math.sqrt(total) * step), name
    changed = any(not torch.equal(secure.params[n], v) for n, v in plain.params.items())
    assert changed  # the rounding shows: the secure path really ran
    assert secure.reports[-1].num_replied == SETTINGS["num_partitions"]


def test_a_dropped_client_within_the_threshold_does_not_fail_the_round(tmp_path):
    plain, _ = _run(tmp_path, "plain", client=failing_client)
    secure, grid = _run(tmp_path, "secure", client=failing_client, secure_aggregation="secaggplus")
    report = secure.reports[-1]
    assert report.round_failed is None and secure.last_round == 1
    assert (report.num_replied, report.num_failed) == (3, 1)  # threshold 3 of 4 shares
    step = 2 * CLIP / 2**24
    total = sum(v.numel() for v in plain.params.values())
    for name, value in plain.params.items():  # the mean of the three survivors
        assert torch.allclose(secure.params[name], value, atol=2 * math.sqrt(total) * step), name
    assert any(reply.has_error() for reply in grid.replies)  # the dropped client's stage 2


@pytest.mark.parametrize("method", ["pfl_dim", "pfl_dim_ema"])
def test_private_secure_run_keeps_the_accountant(tmp_path, method):
    result, _ = _run(tmp_path, method, secure_aggregation="secaggplus", method=method,
                     noise_multiplier=0.8, sampling_rate=0.75, number_of_rounds=3, noise_seed=1,
                     sampler_seed=2, aggregation=None, ema_warmup_rounds=1)  # fmt: skip
    expected = compute_epsilon(sampling_rate=0.75, noise_multiplier=0.8, rounds=3, delta=1e-5)
    assert math.isclose(result.epsilon, expected, rel_tol=1e-9)
    assert result.last_round == 3
    assert all(r.noise_std and r.noise_std > 0 for r in result.reports)
    assert all(r.component_budgets for r in result.reports)  # the privacy report's sigma_eff


def partial_client(context, settings):
    """Partition 0 returns only the weight (a shallow client); the others the whole model."""
    task = toy_client(context, settings)
    pid = int(context.node_config["partition-id"])
    names = ["model.weight"] if pid == 0 else ["model.weight", "model.bias"]
    task.partial = lambda brain: (names, {"exit-depth": 1 if pid == 0 else 2})
    # unequal partitions, so the samples weighting differs from the uniform one
    keep = 8 * (pid + 1)
    task.train_set.x, task.train_set.y = task.train_set.x[:keep], task.train_set.y[:keep]
    return task


@pytest.mark.parametrize("rule", ["layerwise_samples", "layerwise_uniform", "momentum"])
def test_layerwise_rule_under_secaggplus_equals_the_plaintext_rule(tmp_path, rule):
    """Masked per-tensor sums and weights give the layer-wise rule; server momentum applies."""
    extra = {"method": "fedavg", "clip": None, "number_of_rounds": 2,
             "aggregation": "layerwise_samples" if rule == "momentum" else rule}  # fmt: skip
    if rule == "momentum":
        from speechbrain_fl.fl.aggregate.layerwise import ServerMomentum, layerwise_rule

        plain_rule = ServerMomentum(layerwise_rule("samples"), momentum=0.5)
        secure_rule = ServerMomentum(layerwise_rule("samples"), momentum=0.5)
    else:
        plain_rule = secure_rule = extra["aggregation"]
    plain, _ = _run(tmp_path, "plain", client=partial_client,
                    **{**extra, "aggregation": plain_rule})  # fmt: skip
    secure, grid = _run(tmp_path, "secure", client=partial_client,
                        secure_aggregation="secaggplus", secagg_clipping_range=8.0,
                        **{**extra, "aggregation": secure_rule})  # fmt: skip
    assert secure.last_round == 2 and secure.reports[-1].num_replied == 4
    for reply in grid.replies:  # no tensor, no depth and no example count in the clear
        assert all(len(record) == 0 for record in reply.content.array_records.values())
        for record in reply.content.config_records.values():
            assert "exit-depth" not in record and "num-examples" not in record
    step, total = 16.0 / 2**24, 2 * sum(v.numel() for v in plain.params.values())
    for name, value in plain.params.items():
        assert torch.allclose(secure.params[name], value, atol=8 * math.sqrt(total) * step), name
    assert any(not torch.equal(secure.params[n], v) for n, v in plain.params.items())


def mostly_failing_client(context, settings):
    """Partitions 1 and 2 of 3 raise while training: one survivor, below the threshold of 2."""
    task = toy_client(context, settings)
    if int(context.node_config["partition-id"]) in (1, 2):
        task.train_set.y = torch.full_like(task.train_set.y, float("nan"))
    return task


def test_a_round_below_the_threshold_is_released_with_the_noise_alone(tmp_path):
    """Too few survivors to unmask: no update is learnt, the draw is still released."""
    result, _ = _run(tmp_path, "halted", client=mostly_failing_client, num_partitions=3,
                     secure_aggregation="secaggplus", noise_multiplier=1.0, aggregation=None,
                     noise_seed=1, sampler_seed=2)  # fmt: skip
    report = result.reports[-1]
    assert (report.num_replied, report.num_failed) == (0, 3)
    assert report.noise_std and report.noise_std > 0  # the noise of n = qK = 3 clients
    expected = compute_epsilon(sampling_rate=1.0, noise_multiplier=1.0, rounds=1, delta=1e-5)
    assert math.isclose(result.epsilon, expected, rel_tol=1e-9)  # one accountant step

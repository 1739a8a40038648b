"""DPFedAvg aggregation: re-clipping, noise exactly once, weighting, faults, client round.

Replies are real Flower Messages; client updates come from the real ClientApp round
(:func:`train_round`) on the toy SpeechBrain Brain, or are built by hand where a test needs a
non-compliant or broken client.
"""

import json
import logging

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from speechbrain_fl.fl import DPFedAvg, FLConfig, RoundFailed, train_round
from speechbrain_fl.fl.toy import toy_client, toy_settings
from speechbrain_fl.privacy import GaussianNoise, Group, Layout


@pytest.fixture(autouse=True)
def _server_identity():
    """Messages are created inside a ServerApp process, whose task identity Flower sets."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


LAYOUT = Layout([Group("model.weight", "all", 4), Group("model.bias", "all", 1)])
GLOBAL = {"model.weight": torch.zeros(1, 4), "model.bias": torch.zeros(1)}


def _strategy(tmp_path, **kw):
    cfg = FLConfig(output_folder=str(tmp_path), **kw)
    strategy = DPFedAvg(config=cfg, layout=LAYOUT)
    strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in GLOBAL.items()})
    return strategy


def _reply(node, delta=None, metrics=None, error=None):
    out = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    if error is not None:
        return Message(Error(code=0, reason=error), reply_to=out)
    content = RecordDict({"arrays": ArrayRecord(delta), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=out)


def _set_round(strategy, cohort, population):
    strategy.cohort, strategy.population = list(cohort), population


def test_server_reclips_noncompliant_client_and_adds_noise_once(tmp_path):
    sigma, clip, q, k = 0.5, 1.0, 0.5, 4
    strategy = _strategy(tmp_path, sampling_rate=q, noise_multiplier=sigma, clip=clip, noise_seed=7)
    _set_round(strategy, [1, 2], k)
    big = {"model.weight": torch.full((1, 4), 10.0), "model.bias": torch.full((1,), 10.0)}
    small = {"model.weight": torch.full((1, 4), 0.1), "model.bias": torch.zeros(1)}
    replies = [_reply(1, big, {"num-examples": 5}), _reply(2, small, {"num-examples": 50})]
    arrays, metrics = strategy.aggregate_train(1, replies)
    new = arrays.to_torch_state_dict()
    # expected: (clip(big) + small) / n with n = qK = 2, plus one draw of the seeded noise
    norm_big = torch.sqrt(torch.tensor(5 * 100.0, dtype=torch.float64))
    n = q * k
    mean = {p: (big[p].double() * clip / norm_big + small[p].double()) / n for p in big}
    noisy = GaussianNoise(noise_multiplier=sigma, clip=clip, seed=7).add(
        mean, expected_cohort_size=n
    )
    for name in GLOBAL:
        torch.testing.assert_close(new[name], noisy[name].float(), rtol=0, atol=1e-6)
    assert strategy.accountant.rounds == 1
    assert strategy.last_report.noise_std == pytest.approx(sigma * clip / (q * k))
    assert metrics["epsilon"] > 0
    # a second aggregate of the same round would draw new noise: the result is not reproduced
    twice = GaussianNoise(noise_multiplier=sigma, clip=clip, seed=7)
    twice.add(mean, expected_cohort_size=n)
    again = twice.add(mean, expected_cohort_size=n)
    assert not torch.allclose(again["model.weight"].float(), new["model.weight"])


def test_weighted_mean_for_plain_fedavg(tmp_path):
    strategy = _strategy(tmp_path)  # no noise, no clip -> num-examples weighting
    _set_round(strategy, [1, 2], 2)
    ones = {k: torch.ones_like(v) for k, v in GLOBAL.items()}
    zeros = {k: torch.zeros_like(v) for k, v in GLOBAL.items()}
    replies = [_reply(1, zeros, {"num-examples": 1}), _reply(2, ones, {"num-examples": 3})]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert torch.allclose(arrays.to_torch_state_dict()["model.weight"], torch.full((1, 4), 0.75))
    assert strategy.accountant is None and strategy.last_report.noise_std is None


def test_private_run_rejects_weighted_rule(tmp_path):
    with pytest.raises(ValueError, match="dp_sensitivity_bounded"):
        _strategy(tmp_path, noise_multiplier=1.0, clip=1.0, aggregation="weighted")


def test_faulty_replies_dropped_with_reason(tmp_path, caplog):
    strategy = _strategy(tmp_path, min_clients=1)
    _set_round(strategy, [1, 2, 3, 4, 5, 6], 6)
    good = {k: torch.ones_like(v) for k, v in GLOBAL.items()}
    nan = {"model.weight": torch.full((1, 4), float("nan")), "model.bias": torch.zeros(1)}
    wrong_name = {"model.weight": torch.zeros(1, 4), "other": torch.zeros(1)}
    wrong_shape = {"model.weight": torch.zeros(4), "model.bias": torch.zeros(1)}
    replies = [
        _reply(1, good, {"num-examples": 2}),
        _reply(2, error="ValueError: boom"),
        _reply(3, nan, {"num-examples": 2}),
        _reply(4, wrong_name, {"num-examples": 2}),
        _reply(5, wrong_shape, {"num-examples": 2}),
    ]  # node 6 never replies (timeout)
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, replies)
    text = caplog.text
    for expected in (
        "node 2: client error",
        "node 3: tensor 'model.weight' has non-finite",
        "node 4: wrong tensor names",
        "node 5: tensor 'model.weight' has shape",
        "node 6: no reply",
    ):
        assert expected in text
    assert strategy.last_report.num_replied == 1 and strategy.last_report.num_failed == 5
    assert torch.equal(arrays.to_torch_state_dict()["model.weight"], torch.ones(1, 4))


def test_too_few_replies_raise_round_failed(tmp_path):
    strategy = _strategy(tmp_path, min_clients=2)
    _set_round(strategy, [1, 2], 2)
    good = {k: torch.ones_like(v) for k, v in GLOBAL.items()}
    with pytest.raises(RoundFailed, match="1 valid replies.*min_clients=2"):
        strategy.aggregate_train(1, [_reply(1, good, {"num-examples": 1}), _reply(2, error="x")])


def test_client_round_clips_with_sent_budgets_and_reports_stats():
    settings = toy_settings(overrides={"lr": 0.5})
    task = toy_client(
        Context(
            run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
        ),
        settings,
    )
    start = {n: p.detach().clone() for n, p in task.brain.modules.named_parameters()}
    budgets = {"model.weight": 0.03, "model.bias": 0.04}
    config = ConfigRecord(
        {
            "server-round": 1,
            "local-epochs": 1,
            "round-seed": 3,
            "clip-budgets": json.dumps(budgets),
            "clip-groups": json.dumps(list(LAYOUT.names)),
            "clip-components": json.dumps(list(LAYOUT.components)),
        }
    )
    content = RecordDict(
        {"arrays": ArrayRecord({k: v.clone() for k, v in start.items()}), "config": config}
    )
    out = train_round(task, content, partition_id=0)
    delta = out["arrays"].to_torch_state_dict()
    metrics = out["metrics"]
    assert delta["model.weight"].norm() <= 0.03 + 1e-6
    assert delta["model.bias"].norm() <= 0.04 + 1e-6
    assert metrics["num-examples"] == settings["examples_per_client"]
    assert metrics["train-loss"] > 0 and metrics["group-clipped"] == [1.0, 1.0]
    assert metrics["group-norms"][0] > 0.03 and metrics["clip-ratio"] < 1.0
    # the Brain is reset to the global parameters after the round
    for name, param in task.brain.modules.named_parameters():
        assert torch.equal(param.detach(), start[name])
    # same round seed -> same update (reproducible rounds)
    again = train_round(task, content, partition_id=0)["arrays"].to_torch_state_dict()
    assert torch.equal(again["model.weight"], delta["model.weight"])

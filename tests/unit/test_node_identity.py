"""Identity in deployment: one node per partition, one data owner once;
its own data and base model: fingerprints, the setup handshake, node_config.

Before: two SuperNodes both declaring ``partition-id=0`` were accepted silently ("2 connected,
K=2"): partition 1 never trained, and in a private run one data owner counted as two clients.
"""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.fl.engines import flwr_apps as apps
from speechbrain_fl.fl.engines.fingerprint import (
    BaseModelMismatch,
    check_base_fingerprint,
    frozen_fingerprint,
)
from speechbrain_fl.fl.node_data import NodeData, localize_settings, pack_folder, unpack_folder
from speechbrain_fl.fl.task import TaskSpec
from speechbrain_fl.fl.toy import toy_settings, write_toy_manifest
from speechbrain_fl.privacy import Group, Layout

from .strategy_toys import ScriptedGrid, make_reply

LAYOUT = Layout([Group("w", "all", 2)])


def _zero_reply(node, partition, server_round, arrays):
    return {k: torch.zeros_like(v) for k, v in arrays.items()}, {"num-examples": 1}


def _strategy(tmp_path, **config):
    cfg = FLConfig(output_folder=str(tmp_path), **config)
    return DPFedAvg(config=cfg, layout=LAYOUT, population_size=2)


PRIVATE = {"noise_multiplier": 1.0, "clip": 1.0, "sampling_rate": 1.0, "noise_seed": 1}


def test_a_partition_claimed_twice_is_refused_and_counted_once(tmp_path, server_identity, caplog):
    grid = ScriptedGrid(_zero_reply, partitions={100: 0, 101: 0, 102: 1})
    strategy = _strategy(tmp_path, **PRIVATE, sampler_seed=3)
    with caplog.at_level(logging.WARNING):
        strategy.learn_node_order(grid, timeout=1.0)
    assert "node 101: refused, partition-id=0 is already claimed by node 100" in caplog.text
    arrays = ArrayRecord({"w": torch.zeros(2)})
    messages = list(strategy.configure_train(1, arrays, {}, grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [100, 102]  # q=1: all but 101
    assert strategy.population == 2  # the data owner of partition 0 counts once
    replies = grid.send_and_receive(messages)
    replies.append(make_reply(101, {"w": torch.ones(2)}, {"num-examples": 1, "partition-id": 0}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
    assert "node 101: refused (partition-id=0 is already claimed by node 100), reply dropped" in (
        caplog.text
    )
    assert strategy.last_report.num_replied == 2


def test_a_reply_claiming_another_partition_than_its_query_answer_is_dropped(
    tmp_path, server_identity, caplog
):
    grid = ScriptedGrid(_zero_reply, partitions={100: 0, 101: 1})
    strategy = _strategy(tmp_path)
    strategy.learn_node_order(grid, timeout=1.0)
    messages = list(strategy.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), {}, grid))
    replies = grid.send_and_receive(messages)
    replies[1] = make_reply(101, {"w": torch.ones(2)}, {"num-examples": 1, "partition-id": 0})
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
    assert "node 101: partition-id=0 differs from the partition-id=1 it answered" in caplog.text
    assert strategy.last_report.num_dropped == 1


def test_node_partitions_binds_authenticated_nodes_to_partitions(tmp_path, server_identity, caplog):
    """A declared binding: an unenrolled node, or one answering another partition, is refused."""
    grid = ScriptedGrid(_zero_reply, partitions={100: 0, 101: 1, 555: 1})
    strategy = _strategy(tmp_path, node_partitions={"100": 0, 101: 1})
    with caplog.at_level(logging.WARNING):
        strategy.learn_node_order(grid, timeout=1.0)
    assert "node 555: refused, its node id is not in node_partitions" in caplog.text
    messages = list(strategy.configure_train(1, ArrayRecord({"w": torch.zeros(2)}), {}, grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [100, 101]
    liar = ScriptedGrid(_zero_reply, partitions={100: 1})
    strategy = _strategy(tmp_path, node_partitions={100: 0, 101: 1})
    with caplog.at_level(logging.WARNING):
        strategy.learn_node_order(liar, timeout=1.0)
    assert "node 100: refused, it answered partition-id=1, but node_partitions binds it" in (
        caplog.text
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({0: 1, 1: 1}, "binds partitions \\[1\\] to more than one node"),
        ({"a": 1}, "non-integer entry"),
        ([1, 2], "must be a mapping"),
        ({3: -1}, "negative partition"),
    ],
)
def test_node_partitions_is_checked(tmp_path, value, message):
    with pytest.raises(ValueError, match=f"federated config: node_partitions=.*{message}"):
        FLConfig(output_folder=str(tmp_path), node_partitions=value)


# -- the node's own data and base model ----------------------------------------
def _base(seed: int) -> torch.nn.Module:
    """A frozen 'encoder' (weights from ``seed``) under a trainable head."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def test_two_different_bases_are_refused_by_name():
    server, same, other = _base(0), _base(0), _base(1)
    expected = frozen_fingerprint(server)
    assert check_base_fingerprint(expected, same) == expected
    with torch.no_grad():  # the trainable head is the server's to send: it does not count
        same[1].weight.add_(1.0)
    assert frozen_fingerprint(same) == expected
    with pytest.raises(BaseModelMismatch, match=r"differs from the server's .*node 7"):
        check_base_fingerprint(expected, other, where="node 7")
    with torch.no_grad():  # one frozen value changed is another base
        same[0].bias[0] += 1e-6
    assert frozen_fingerprint(same) != expected


def _context(node_config, run_config, state=None):
    return Context(run_id=5, node_id=11, node_config=node_config,
                   state=state or RecordDict(), run_config=run_config)  # fmt: skip


def _setup_message(fingerprint: str) -> Message:
    content = RecordDict(
        {
            apps.SETUP_RECORD: ConfigRecord(
                {"fingerprint": fingerprint, "prepared": "", "shipped": False}
            )
        }  # fmt: skip
    )
    return Message(content=content, dst_node_id=11, message_type=apps.SETUP)


@pytest.fixture
def toy_node(tmp_path):
    settings = toy_settings(overrides={"num_partitions": 2})
    folder = tmp_path / "node0"
    folder.mkdir()
    write_toy_manifest(folder / "train.csv", settings, 0)
    node_config = {"partition-id": 0, "num-partitions": 2, "data-folder": str(folder),
                   "work-dir": str(tmp_path / "work")}  # fmt: skip
    run_config = {"task": "speechbrain_fl.fl.toy:toy_task", "hparams": "",
                  "overrides": "{num_partitions: 2, number_of_rounds: 1}"}  # fmt: skip
    return node_config, run_config


def test_setup_handshake_admits_the_same_base_and_refuses_another(toy_node, server_identity):
    node_config, run_config = toy_node
    client = apps._RunConfigClient()
    with pytest.raises(apps.NodeNotSetUp, match="before the server's setup"):
        client(_context(node_config, run_config))  # no setup yet: refused
    right = frozen_fingerprint(torch.nn.Linear(4, 1))  # the toy's base: nothing frozen
    context = _context(node_config, run_config)
    reply = apps._setup(_setup_message(right), context)
    answer = reply.content.config_records[apps.REPLY_RECORD]
    assert answer["ok"] is True
    built = client(context)  # a later message's build: checked again, on the node's own data
    assert len(built.train_set) == 32
    wrong = frozen_fingerprint(_base(3))
    context = _context(node_config, run_config)
    reply = apps._setup(_setup_message(wrong), context)
    answer = reply.content.config_records[apps.REPLY_RECORD]
    assert answer["ok"] is False and answer["error"].startswith("BaseModelMismatch")
    with pytest.raises(apps.NodeNotSetUp):
        client(context)


class _FakeGrid:
    """Two connected nodes; node 2 answers the setup with a refusal."""

    def __init__(self):
        self.sent = []

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg.metadata.dst_node_id)
            ok = msg.metadata.dst_node_id == 1
            answer = {"ok": ok, "error": "" if ok else "BaseModelMismatch: another base"}
            replies.append(
                Message(RecordDict({apps.REPLY_RECORD: ConfigRecord(answer)}), reply_to=msg)
            )
        return replies


def test_admitting_grid_hides_a_refused_node(server_identity):
    grid = apps.AdmittingGrid(_FakeGrid(), RecordDict())
    assert grid.get_node_ids() == [1]
    assert grid.get_node_ids() == [1]  # asked once: no second setup
    assert grid._grid.sent == [1, 2]
    assert grid.refused == {2: "BaseModelMismatch: another base"}


def test_admitting_grid_sets_up_a_node_again_when_it_returns(server_identity):
    fake = _FakeGrid()
    grid = apps.AdmittingGrid(fake, RecordDict())
    assert grid.get_node_ids() == [1]
    fake.get_node_ids = lambda: [2]  # node 1 is gone (its SuperNode was killed)
    assert grid.get_node_ids() == []
    fake.get_node_ids = lambda: [1, 2]  # and back, restarted with its key: set up again
    assert grid.get_node_ids() == [1]
    assert fake.sent == [1, 2, 1]


def test_admitting_grid_sets_up_a_node_that_lost_its_setup(server_identity):
    fake = _FakeGrid()
    grid = apps.AdmittingGrid(fake, RecordDict())
    assert grid.get_node_ids() == [1]
    train = Message(RecordDict(), dst_node_id=1, message_type="train")
    lost = Message(Error(0, "<class 'speechbrain_fl.fl.engines.flwr_apps.NodeNotSetUp'>:<'node 1'>"),
                   reply_to=train)  # fmt: skip
    real = fake.send_and_receive
    fake.send_and_receive = lambda messages, timeout=None: [lost]
    assert grid.send_and_receive([train]) == [lost]  # the round sees the failed reply
    fake.send_and_receive = real
    assert grid.get_node_ids() == [1]
    assert fake.sent == [1, 2, 1]


def test_node_config_and_localized_settings(tmp_path):
    with pytest.raises(ValueError, match="data-folder='/no/such'"):
        NodeData.from_node_config({"data-folder": "/no/such"})
    manifest = tmp_path / "mine.csv"
    manifest.write_text("ID\n")
    node = NodeData.from_node_config({"data-manifest": str(manifest), "device": "cuda:1",
                                      "work-dir": str(tmp_path)})  # fmt: skip
    server = {"clients": ["/srv/p0.csv", "/srv/p1.csv", "/srv/p2.csv"], "data_folder": "/srv",
              "valid_csv": "/srv/dev.csv", "test_csv": "/srv/test.csv", "run_opts": {},
              "model": {"folder": "/srv/cache/seed", "cache_dir": "/srv/cache"}}  # fmt: skip
    local = localize_settings(server, node, manifest=node.train_manifest, model_folder="/m")
    assert local["clients"] == [str(manifest)] * 3  # K kept, no other client's manifest
    assert "/srv" not in str({k: v for k, v in local.items() if k != "model"})
    assert local["model"] == {"folder": "/m", "cache_dir": str(tmp_path / "cache")}
    assert local["run_opts"]["device"] == "cuda:1"
    shipped = tmp_path / "seed"
    (shipped / "sub").mkdir(parents=True)
    (shipped / "sub" / "w.bin").write_bytes(b"\x00\x01")
    files = pack_folder(shipped)
    unpack_folder(files, tmp_path / "copy")
    assert (tmp_path / "copy" / "sub" / "w.bin").read_bytes() == b"\x00\x01"
    with pytest.raises(ValueError, match="outside"):
        unpack_folder({"../evil": b""}, tmp_path / "copy")


def test_typed_run_config_keys():
    spec = TaskSpec.from_run_config({"num-server-rounds": 4, "noise-multiplier": 0.0,
                                     "method": "flat", "sampling-rate": -1.0,
                                     "overrides": "{clip: 1.0}"})  # fmt: skip
    assert dict(spec.overrides) == {"clip": 1.0, "number_of_rounds": 4,
                                    "noise_multiplier": 0.0, "method": "flat"}  # fmt: skip
    with pytest.raises(ValueError, match="num-server-rounds=4 and overrides number_of_rounds"):
        TaskSpec.from_run_config({"num-server-rounds": 4, "overrides": "{number_of_rounds: 3}"})
    with pytest.raises(ValueError, match="local-epochs=1.5 must be an integer"):
        TaskSpec.from_run_config({"local-epochs": 1.5})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rounds'\]"):
        TaskSpec.from_run_config({"rounds": 3})


def test_run_deployment_refuses_the_managed_local_superlink(tmp_path):
    from speechbrain_fl.fl.engines.run import run_deployment

    (tmp_path / "config.toml").write_text('[superlink.local]\naddress = ":local:"\n')
    with pytest.raises(ValueError, match="'local' .* address ':local:'.*keeps running"):
        run_deployment("local", env={"FLWR_HOME": str(tmp_path)})


def test_a_data_owning_node_prepares_nothing(tmp_path):
    from speechbrain_fl.fl.node_data import bound_node
    from speechbrain_fl.recipe import FederatedRecipe, RunSettings

    recipe = FederatedRecipe(recipe_dir=tmp_path, task_ref="x.py:f", default_hparams="h.yaml",
                             check=lambda hparams: None)  # fmt: skip
    hparams = {"output_folder": str(tmp_path / "out"), "save_folder": str(tmp_path / "save")}
    server = RunSettings(clients=["/srv/p0.csv", "/srv/p1.csv"], data_folder="/srv",
                         valid_csv="/srv/dev.csv", test_csv="/srv/test.csv",
                         model={"folder": "/srv/seed", "cache_dir": "/srv/cache"})  # fmt: skip
    made = recipe.prepare(hparams, {}, make=lambda hparams, run_opts: {
        "settings": server.to_dict(), "info": {"n": 2}})  # fmt: skip
    task = recipe.task(RunSettings.from_dict(made["settings"]), build_client=print,
                       build_server=print)  # fmt: skip
    sent = task.node_setup["prepared"]  # none of the server's data paths reach the nodes
    assert sent["settings"]["clients"] == ["", ""] and "/srv/p0" not in str(sent)
    assert task.node_setup["model_folder"] == "/srv/seed"
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "train.csv").write_text("ID\n")
    node = NodeData.from_node_config({"data-folder": str(tmp_path / "node"),
                                      "work-dir": str(tmp_path / "w")})  # fmt: skip

    def never(hparams, run_opts):
        raise AssertionError("a data-owning node must not prepare the corpus")

    with bound_node(node, {"prepared": sent, "model_folder": str(tmp_path / "w" / "m")}):
        local = recipe.prepare(hparams, {}, make=never)
    assert local["info"] == {"n": 2}
    assert local["settings"]["clients"] == [str(tmp_path / "node" / "train.csv")] * 2
    assert local["settings"]["model"]["folder"] == str(tmp_path / "w" / "m")
    with bound_node(node, None), pytest.raises(RuntimeError, match="has not received"):
        recipe.prepare(hparams, {}, make=never)

"""A two-tensor global model, a DPFedAvg over it, and hand-built client replies.

Shared by the strategy's unit tests (test_fl_strategy.py, test_fl_privacy_hardening.py): the
replies are real Flower Messages, built by hand where a test needs a chosen delta, a
non-compliant client or an error reply.
"""

import torch
from flwr.app import ArrayRecord, Error, Message, MessageType, MetricRecord, RecordDict

from speechbrain_fl.fl import DPFedAvg, FLConfig
from speechbrain_fl.privacy import Group, Layout

LAYOUT = Layout([Group("model.weight", "all", 4), Group("model.bias", "all", 1)])
GLOBAL = {"model.weight": torch.zeros(1, 4), "model.bias": torch.zeros(1)}


def make_strategy(tmp_path, layout=LAYOUT, **config):
    """A DPFedAvg writing into ``tmp_path`` whose global model is :data:`GLOBAL`."""
    strategy = DPFedAvg(config=FLConfig(output_folder=str(tmp_path), **config), layout=layout)
    strategy.current_arrays = ArrayRecord({k: v.clone() for k, v in GLOBAL.items()})
    return strategy


def make_reply(node, delta=None, metrics=None, error=None):
    """A training reply from ``node``: ``delta`` and ``metrics``, or an error reply."""
    out = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    if error is not None:
        return Message(Error(code=0, reason=error), reply_to=out)
    content = RecordDict({"arrays": ArrayRecord(delta), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=out)


def ones():
    """A delta of ones on every global tensor."""
    return {k: torch.ones_like(v) for k, v in GLOBAL.items()}


class ScriptedGrid:
    """A Grid whose nodes answer with scripted replies (hostile clients, chosen deltas).

    ``reply(node, partition, round, global_arrays) -> (delta, metrics)`` gives each sampled
    node's training reply; query messages are answered with ``partition-id`` (node ``100 + i``
    has partition ``i`` unless ``partitions`` says otherwise).
    """

    def __init__(self, reply, num_nodes=3, partitions=None):
        self.reply = reply
        self.partitions = partitions or {100 + i: i for i in range(num_nodes)}
        self.rounds = 0

    def get_node_ids(self):
        return list(self.partitions)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for message in messages:
            node = message.metadata.dst_node_id
            if message.metadata.message_type == MessageType.QUERY:
                content = RecordDict(
                    {"metrics": MetricRecord({"partition-id": self.partitions[node]})}
                )
                out.append(Message(content, reply_to=message))
                continue
            config = message.content["config"]
            arrays = message.content["arrays"].to_torch_state_dict()
            delta, metrics = self.reply(
                node, self.partitions[node], int(config["server-round"]), arrays
            )
            metrics = {"partition-id": self.partitions[node], **metrics}
            content = RecordDict({"arrays": ArrayRecord(delta), "metrics": MetricRecord(metrics)})
            out.append(Message(content, reply_to=message))
        return out

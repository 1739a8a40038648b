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

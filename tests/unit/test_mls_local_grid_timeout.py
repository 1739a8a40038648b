"""The local backend's timeout is per client (a sequential cohort is not cut off by the total)."""

import logging
import time

from flwr.app import Message, RecordDict
from flwr.clientapp import ClientApp

from speechbrain_fl.fl.engines.local_grid import LocalGrid

SLEEP = {0: 0.15, 1: 0.15, 2: 0.15, 3: 0.6}  # seconds each partition's client takes


def _app():
    app = ClientApp()

    @app.query()
    def query(msg, context):
        time.sleep(SLEEP[int(context.node_config["partition-id"])])
        return Message(RecordDict(), reply_to=msg)

    return app


def _partition(grid, reply):
    return int(grid.contexts[reply.metadata.src_node_id].node_config["partition-id"])


def test_each_client_gets_the_timeout_and_a_slow_one_is_dropped_and_logged(caplog):
    grid = LocalGrid(_app(), num_nodes=4)
    with grid.identity(), caplog.at_level(logging.WARNING):
        queries = [Message(RecordDict(), n, "query") for n in grid.get_node_ids()]
        replies = grid.send_and_receive(queries, timeout=0.4)
    # 0.45 s of fast clients in all, over the 0.4 s timeout: a cohort-wide deadline would have
    # dropped partition 2 before it started; per client, only the 0.6 s client is dropped
    assert sorted(_partition(grid, r) for r in replies) == [0, 1, 2]
    assert [d[0] for d in grid.dropped] == [3] and grid.dropped[0][1] > 0.4
    assert "partition 3 took" in caplog.text and "dropped from the round" in caplog.text


def test_no_timeout_keeps_every_reply():
    grid = LocalGrid(_app(), num_nodes=4)
    with grid.identity():
        queries = [Message(RecordDict(), n, "query") for n in grid.get_node_ids()]
        replies = grid.send_and_receive(queries)
    assert len(replies) == 4 and grid.dropped == []

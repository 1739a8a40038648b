"""Fixtures shared by the unit tests of the server strategy."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def server_identity():
    """Messages are created inside a ServerApp process, whose task identity Flower sets."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved

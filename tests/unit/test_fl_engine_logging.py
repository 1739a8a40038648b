"""run_simulation's logging: Flower's lines once, without its run_simulation deprecation notice."""

import logging

from flwr.common.logger import FLOWER_LOGGER, console_handler

from speechbrain_fl.fl.engine import DEPRECATION_NOTICE, _flower_logging


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_flower_lines_go_through_the_scripts_handlers_once_without_the_notice():
    root = logging.getLogger()
    collect = _Collect()
    root.addHandler(collect)
    try:
        assert console_handler in FLOWER_LOGGER.handlers
        with _flower_logging():
            assert console_handler not in FLOWER_LOGGER.handlers  # not printed twice
            FLOWER_LOGGER.warning("The %s and will be removed", DEPRECATION_NOTICE)
            FLOWER_LOGGER.warning("round 1/2 | cohort 2/2")
        assert console_handler in FLOWER_LOGGER.handlers  # restored for everyone else
        FLOWER_LOGGER.warning("The %s again", DEPRECATION_NOTICE)  # filtered in the call only
    finally:
        root.removeHandler(collect)
    assert collect.messages[0] == "round 1/2 | cohort 2/2"
    assert DEPRECATION_NOTICE in collect.messages[1] and len(collect.messages) == 2

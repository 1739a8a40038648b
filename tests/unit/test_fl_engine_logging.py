"""run_simulation's logging: Flower's lines once, without its run_simulation deprecation notice."""

import logging

import pytest
from flwr.common.logger import FLOWER_LOGGER, console_handler

from speechbrain_fl.fl.engines.run import DEPRECATION_NOTICE, _flower_logging


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


# -- the round lines through the task's train_logger (SpeechBrain's TensorboardLogger) ---------
def _scalars(folder):
    """``{tag: [(step, value), ...]}`` of the TensorBoard event files under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _toy_run(tmp_path, train_logger, rounds=3):
    import dataclasses
    import functools

    from speechbrain_fl.fl import FLTask, run_simulation
    from speechbrain_fl.fl.toy import toy_client, toy_server, toy_settings

    settings = toy_settings(
        overrides={
            "num_partitions": 2, "number_of_rounds": rounds, "eval_every": 1,
            "method": "flat", "clip": 0.5, "noise_multiplier": 0.8, "sampling_rate": 1.0,
            "noise_seed": 1, "sampler_seed": 2, "output_folder": str(tmp_path / "out"),
        }
    )  # fmt: skip

    def build_server(context):
        return dataclasses.replace(toy_server(context, settings), train_logger=train_logger)

    task = FLTask(
        build_client=functools.partial(toy_client, settings=settings),
        build_server=build_server,
        num_partitions=2,
    )
    return run_simulation(task, backend="local")


def test_round_lines_go_through_the_yamls_train_logger_speechbrain_tensorboard(tmp_path):
    """SpeechBrain's own TensorboardLogger as the task's train_logger: rounds, the train loss,
    the validation loss and epsilon are TensorBoard scalars (and no train_log.txt is written)."""
    pytest.importorskip("tensorboard")
    from speechbrain.utils.train_logger import TensorboardLogger

    tb = TensorboardLogger(str(tmp_path / "tb"))
    result = _toy_run(tmp_path, tb)
    tb.writer.flush()
    scalars = _scalars(tmp_path / "tb")
    # the per-round figure is named by its accountant (round_accountant: rdp)
    assert {"round", "epsilon_rdp", "loss/train", "valid_loss/valid"} <= set(scalars)
    assert [v for _, v in scalars["round"]] == [0, 1, 2, 3]  # round 0 = the starting model
    epsilons = [v for _, v in scalars["epsilon_rdp"]]
    assert len(epsilons) == 3 and epsilons == sorted(epsilons)  # spent, round after round
    assert epsilons[-1] == pytest.approx(result.privacy["epsilon_rdp"], rel=1e-6)
    assert epsilons[-1] >= result.epsilon  # the guarantee (PLD) is the tighter figure
    assert len(scalars["loss/train"]) == 3 and len(scalars["valid_loss/valid"]) == 4
    assert not (tmp_path / "out" / "train_log.txt").exists()


def test_round_tensorboard_logger_steps_are_rounds_and_text_meta_is_text(tmp_path):
    pytest.importorskip("tensorboard")
    from speechbrain_fl.recipe.train_logger import RoundTensorboardLogger

    tb = RoundTensorboardLogger(str(tmp_path / "tb"))
    # a recipe's own line (text meta) then the engine's, with a round that skipped evaluation
    tb.log_stats({"stage": "seed pretraining", "steps": 4}, train_stats={"loss": 5.4})
    tb.log_stats({"round": 0, "stage": "test"}, test_stats={"WER": 0.9})
    tb.log_stats({"round": 1, "epsilon": 0.5}, train_stats={"loss": 2.0})
    tb.log_stats({"round": 4, "epsilon": 1.0}, train_stats={"loss": 1.5}, valid_stats={"WER": 0.7})
    scalars = _scalars(tmp_path / "tb")
    assert scalars["WER/test"] == [(0, pytest.approx(0.9))]
    assert scalars["WER/valid"] == [(4, pytest.approx(0.7))]  # at its round, not call 3
    assert [s for s, _ in scalars["loss/train"]] == [1, 4]
    assert [s for s, _ in scalars["epsilon"]] == [1, 4] and "stage" not in scalars
    assert scalars["seed pretraining/loss/train"] == [(4, pytest.approx(5.4))]  # not round 4's


def test_default_train_logger_is_a_file_train_logger_on_train_log_txt(tmp_path):
    _toy_run(tmp_path, None, rounds=2)
    lines = (tmp_path / "out" / "train_log.txt").read_text().splitlines()
    assert [line.split(",")[0].split(" - ")[0] for line in lines] == [
        "round: 0", "round: 1", "round: 2"
    ]  # fmt: skip
    assert "epsilon_rdp: " in lines[1] and "train loss" in lines[1]


# -- readable recipe logs ----------------------------------------------------------------------
def test_quiet_recipe_logs_third_party_debug_off_model_statistics_once():
    from speechbrain_fl.utils.logging import TORCHVISION_WARNING, quiet_recipe_logs

    quiet_recipe_logs()
    collect = _Collect()
    collect.setLevel(logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(collect)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    try:
        logging.getLogger("matplotlib.font_manager").debug("findfont: score 10.05")
        logging.getLogger("matplotlib.font_manager").warning("font not found")
        core = logging.getLogger("speechbrain.core")
        for _ in range(3):  # one Brain per client
            core.info("ClientBrain Model Statistics:\n* Total Number of Parameters: 10")
        core.info("Using training precision")
        logging.getLogger("speechbrain.utils.train_logger").warning(TORCHVISION_WARNING)
        logging.getLogger("speechbrain_fl.x").debug("ours at debug")
    finally:
        root.removeHandler(collect)
        root.setLevel(old_level)
    messages = collect.messages
    assert "findfont: score 10.05" not in messages and "font not found" in messages
    assert sum("Model Statistics" in m for m in messages) <= 1  # once per process
    assert "Using training precision" in messages and "ours at debug" in messages
    assert TORCHVISION_WARNING not in messages


def test_hf_bars_go_off_without_importing_transformers():
    """A Brain's first "Model Statistics" line turns the Hugging Face bars off; a process that
    never loads a Hugging Face model does not import transformers for it (~1 s of start-up),
    and transformers imported later starts with its bars off."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch, speechbrain_fl\n"
        "from speechbrain_fl.fl.toy import ToyBrain\n"
        "ToyBrain(modules={'m': torch.nn.Linear(2, 1)}, run_opts={'device': 'cpu'})\n"
        "assert 'transformers' not in sys.modules, 'imported'\n"
        "from transformers.utils import logging as hf\n"
        "assert not hf.is_progress_bar_enabled(), 'bars on'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env.pop("SB_FL_VERBOSE_LOGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


BRAINS = """
import sys
import speechbrain as sb
import torch
import speechbrain_fl  # noqa: F401 (installs the log filters, as in every process of a run)

sb.create_experiment_directory(sys.argv[1])
for _ in range(5):  # a process that trains five clients builds five Brains
    sb.Brain(modules={"m": torch.nn.Linear(2, 2)}, hparams={"max_grad_norm": 1.0},
             run_opts={"device": "cpu"})
print("done")
"""


def test_brain_start_up_lines_go_to_log_txt_once_per_process_never_to_the_console(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SB_FL_VERBOSE_LOGS"}
    proc = subprocess.run(
        [sys.executable, "-c", BRAINS, str(tmp_path)], capture_output=True, text=True,
        env={**env, "OMP_NUM_THREADS": "1"}, cwd=os.getcwd(), timeout=300, check=True,
    )  # fmt: skip
    console = proc.stdout + proc.stderr
    log_txt = (tmp_path / "log.txt").read_text()
    assert "done" in proc.stdout
    for line in ("Run option max_grad_norm from hparams is used", "Gradscaler enabled:",
                 "Using training precision:", "Using evaluation precision:"):  # fmt: skip
        assert console.count(line) == 0, line
        assert log_txt.count(line) == 1, line
    # the model statistics block stays: once per process
    assert console.count("Model Statistics:") == 1

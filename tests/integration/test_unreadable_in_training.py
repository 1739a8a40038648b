"""Training audio that fails to decode reaches the run's outputs.

Two simulated clients read FLAC/WAV files through :func:`guarded_read` (the recipes' path):
partition 0 has three good files and one whose header reads but whose frames are noise after
byte 200, partition 1 only such files. The run goes on (a skipped utterance costs one example, a
client with none readable replies a zero update), each round's ``rounds.csv`` row counts the
skipped utterances, one warning per round says so and names partition 1, and the run's result
(results.json ``data.unreadable_in_training`` in the recipes) sums them over the rounds.
"""

from __future__ import annotations

import csv
import functools
import logging

import numpy as np
import soundfile as sf
import speechbrain as sb
import torch

from speechbrain_fl.data.audio_check import guarded_read
from speechbrain_fl.fl import run_simulation
from speechbrain_fl.fl.clientapp.train import ClientTask
from speechbrain_fl.fl.serverapp.task import ServerTask
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.fl.task import FLTask

ROUNDS = 2


def _wav(path, seed: int) -> str:
    rng = np.random.default_rng(seed)
    sf.write(path, (0.1 * rng.standard_normal(3200)).astype("float32"), 16000)
    return str(path)


def _undecodable(path, seed: int) -> str:
    """A FLAC whose header passes ``soundfile.info`` and whose frames are noise after byte 200."""
    good = _wav(path, seed)
    data = bytearray(open(good, "rb").read())
    data[200:] = np.random.default_rng(seed).integers(0, 256, len(data) - 200, np.uint8).tobytes()
    with open(good, "wb") as handle:
        handle.write(bytes(data))
    sf.info(good)
    return good


class _Brain(sb.Brain):
    def compute_forward(self, batch, stage):
        return self.modules.model(batch.sig.data[:, :10])

    def compute_objectives(self, predictions, batch, stage):
        return predictions.pow(2).mean()


def _brain() -> _Brain:
    torch.manual_seed(0)
    return _Brain(
        modules={"model": torch.nn.Linear(10, 1)},
        opt_class=lambda params: torch.optim.SGD(params, lr=0.1),
        run_opts={"device": "cpu", "noprogressbar": True},
    )


def _dataset(paths: list[str]):
    rows = {f"u{i}": {"wav": p} for i, p in enumerate(paths)}
    dataset = sb.dataio.dataset.DynamicItemDataset(rows)

    @sb.utils.data_pipeline.takes("wav")
    @sb.utils.data_pipeline.provides("sig")
    def audio(wav):
        return guarded_read(sb.dataio.dataio.read_audio, wav, wav)

    sb.dataio.dataset.add_dynamic_item([dataset], audio)
    sb.dataio.dataset.set_output_keys([dataset], ["id", "sig"])
    return dataset


def _client(context, *, files):
    paths = files[int(context.node_config["partition-id"])]
    return ClientTask(
        brain=_brain(), train_set=_dataset(paths), train_loader_kwargs={"batch_size": 2}
    )


def _server(context, *, out):
    config = FLConfig.from_hparams(
        {"number_of_rounds": ROUNDS, "sampling_rate": 1.0, "output_folder": str(out)}
    )
    return ServerTask(brain=_brain(), config=config, min_available_nodes=2, num_partitions=2)


def test_undecodable_training_audio_is_counted_per_round_and_run(tmp_path, caplog):
    good = [_wav(tmp_path / f"good{i}.wav", i) for i in range(3)]
    files = [good + [_undecodable(tmp_path / "cut0.flac", 10)],
             [_undecodable(tmp_path / f"cut{i}.flac", 10 + i) for i in (1, 2)]]  # fmt: skip
    out = tmp_path / "out"
    task = FLTask(
        build_client=functools.partial(_client, files=files),
        build_server=functools.partial(_server, out=out),
        num_partitions=2,
    )
    with caplog.at_level(logging.WARNING):
        result = run_simulation(task)
    with open(out / "rounds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert [r["unreadable_utterances"] for r in rows] == ["", "3", "3"]  # 1 + 2 each round
    assert all(r["num_replied"] == "2" for r in rows[1:])  # nobody's round was lost
    assert result.unreadable_in_training == {
        "utterances": 6,
        "rounds": [1, 2],
        "clients_with_none_readable": [1],
    }
    lines = [r.getMessage() for r in caplog.records if "failed to decode" in r.getMessage()]
    assert len(lines) == ROUNDS and all("partitions [1]" in line for line in lines), lines

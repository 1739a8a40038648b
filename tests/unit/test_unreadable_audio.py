"""An unreadable audio file costs one utterance, not a client (speechbrain_fl/data/audio_check.py,
speechbrain_fl/fl/clientapp/train.py and client.py): a header check at preparation lists it; a
file whose header passes but whose decoding fails is dropped by the client's collate function
and counted in its reply; a client with no readable utterance replies a zero update and says so."""

from __future__ import annotations

import numpy as np
import soundfile as sf
import speechbrain as sb
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from speechbrain.dataio.batch import PaddedBatch

from speechbrain_fl.data.audio_check import (
    EMPTY_BATCH,
    SkippingCollate,
    Unreadable,
    guarded_read,
    read_headers,
)
from speechbrain_fl.fl.clientapp.train import ClientTask, train_round
from speechbrain_fl.fl.params import trainable_state


def _wav(path, seconds=0.2, seed=0):
    rng = np.random.default_rng(seed)
    sf.write(path, (0.1 * rng.standard_normal(int(16000 * seconds))).astype("float32"), 16000)
    return str(path)


def _corrupt(path):
    """A FLAC file whose header passes ``soundfile.info`` but whose frames cannot be decoded:
    every byte after the first 200 (the stream info) replaced by noise."""
    good = _wav(path)
    data = bytearray(open(good, "rb").read())
    noise = np.random.default_rng(0).integers(0, 256, len(data) - 200, dtype=np.uint8)
    data[200:] = noise.tobytes()
    with open(good, "wb") as handle:
        handle.write(bytes(data))
    return good


def test_read_headers_lists_what_is_not_audio(tmp_path):
    good = _wav(tmp_path / "a.wav")
    text = tmp_path / "b.flac"
    text.write_text("not audio")
    missing = str(tmp_path / "c.flac")
    durations, unreadable = read_headers([good, str(text), missing], workers=2, progress=False)
    assert list(durations) == [good] and abs(durations[good] - 0.2) < 1e-9
    assert sorted(unreadable) == sorted([str(text), missing])
    assert all(reason for reason in unreadable.values())


def test_skipping_collate_drops_and_counts():
    collate = SkippingCollate(PaddedBatch)
    bad = {"id": "b", "sig": Unreadable("b.wav", "LibsndfileError: x")}
    batch = collate([{"id": "a", "sig": torch.ones(3)}, bad, {"id": "c", "sig": torch.ones(2)}])
    assert batch.id == ["a", "c"] and batch.sig.data.shape == (2, 3)
    assert collate.skipped == {"b.wav": "LibsndfileError: x"}
    assert collate([bad]) is EMPTY_BATCH
    collate.reset()
    assert collate.skipped == {}
    examples = [{"id": "a", "sig": torch.ones(3)}]
    assert collate(examples).id == ["a"]  # no marker: the batch as the collate makes it


def test_guarded_read_marks_a_file_that_fails_to_decode(tmp_path, caplog):
    path = _corrupt(tmp_path / "cut.flac")
    sf.info(path)  # the header passes
    marker = guarded_read(sb.dataio.dataio.read_audio, path, path)
    assert isinstance(marker, Unreadable) and marker.path == path
    assert path in caplog.text


class _Brain(sb.Brain):
    def compute_forward(self, batch, stage):
        return self.modules.model(batch.sig.data[:, :10])

    def compute_objectives(self, predictions, batch, stage):
        return predictions.pow(2).mean()


def _client(paths):
    rows = {f"u{i}": {"wav": p} for i, p in enumerate(paths)}
    dataset = sb.dataio.dataset.DynamicItemDataset(rows)

    @sb.utils.data_pipeline.takes("wav")
    @sb.utils.data_pipeline.provides("sig")
    def audio(wav):
        return guarded_read(sb.dataio.dataio.read_audio, wav, wav)

    sb.dataio.dataset.add_dynamic_item([dataset], audio)
    sb.dataio.dataset.set_output_keys([dataset], ["id", "sig"])
    torch.manual_seed(0)
    brain = _Brain(
        modules={"model": torch.nn.Linear(10, 1)},
        opt_class=lambda params: torch.optim.SGD(params, lr=0.1),
        run_opts={"device": "cpu", "noprogressbar": True},
    )
    return ClientTask(brain=brain, train_set=dataset, train_loader_kwargs={"batch_size": 2})


def _round(client, server_round=1):
    params = trainable_state(client.brain.modules)
    config = {"round-seed": 7 * server_round, "local-epochs": 2, "server-round": server_round}
    content = RecordDict({"arrays": ArrayRecord(params), "config": ConfigRecord(config)})
    return train_round(client, content, partition_id=3)


def test_a_client_loses_only_the_utterance_it_cannot_decode(tmp_path):
    paths = [_wav(tmp_path / f"{i}.wav", seed=i) for i in range(4)]
    paths.append(_corrupt(tmp_path / "cut.flac"))
    reply = _round(_client(paths))
    metrics = dict(reply["metrics"])
    assert metrics["unreadable-utterances"] == 1 and metrics["readable-utterances"] == 4
    delta = reply["arrays"].to_torch_state_dict()
    assert any(v.abs().sum() > 0 for v in delta.values())  # the readable four trained
    again = dict(_round(_client(paths), server_round=2)["metrics"])
    assert again["unreadable-utterances"] == 1  # counted per round, not accumulated


def test_a_client_with_no_readable_utterance_says_so(tmp_path, caplog):
    paths = [_corrupt(tmp_path / f"cut{i}.flac") for i in range(3)]
    reply = _round(_client(paths))
    metrics = dict(reply["metrics"])
    assert metrics["readable-utterances"] == 0 and metrics["unreadable-utterances"] == 3
    assert all(v.abs().sum() == 0 for v in reply["arrays"].to_torch_state_dict().values())
    assert "partition 3: no readable utterance" in caplog.text


def test_a_readable_client_replies_no_unreadable_metric(tmp_path):
    paths = [_wav(tmp_path / f"{i}.wav", seed=i) for i in range(3)]
    assert "unreadable-utterances" not in dict(_round(_client(paths))["metrics"])

"""recipes/MLS/mls_central.py: the centralized ceiling's step budget, stages and pooled data."""

import csv
import math
import sys
from pathlib import Path

import pytest
import speechbrain as sb
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "MLS"))
import mls_central  # noqa: E402

from speechbrain_fl.recipe.schedules import RoundCosineLR  # noqa: E402


def test_step_budget_is_the_federated_runs_expected_steps():
    """T q E sum_i ceil(n_i / B): a client of 17 utterances makes 2 batches an epoch."""
    sizes = [16, 17, 5, 33]
    batches = sum(math.ceil(n / 16) for n in sizes)  # 1 + 2 + 1 + 3 = 7
    assert batches == 7
    got = mls_central.step_budget(
        sizes, batch_size=16, local_epochs=10, sampling_rate=0.1, rounds=12
    )
    assert got == round(12 * 0.1 * 10 * 7) == 84


@pytest.mark.parametrize(("total", "stages"), [(84, 12), (5, 12), (1597, 12)])
def test_stage_steps_sum_to_the_total(total, stages):
    steps = mls_central.stage_steps(total, stages)
    assert len(steps) == stages and sum(steps) == total and max(steps) - min(steps) <= 1


class _Counting(sb.Brain):
    """A one-weight Brain that records each optimizer step's learning rate."""

    def compute_forward(self, batch, stage):
        return self.modules.lin(batch.x.data)

    def compute_objectives(self, predictions, batch, stage):
        return (predictions**2).mean()

    def init_optimizers(self):
        self.optimizer = torch.optim.SGD(self.modules.lin.parameters(), lr=self.round_lr())
        self.optimizers_dict = {"optimizer": self.optimizer}
        self.fresh = getattr(self, "fresh", 0) + 1

    def round_lr(self):
        return self.hparams.lr_schedule(self.fl_round, self.fl_num_rounds)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        self.last_stats = {"loss": stage_loss}

    def on_fit_batch_end(self, batch, outputs, loss, should_step):
        self.seen.append((self.optimizer.param_groups[0]["lr"], len(batch.x.data)))


def test_train_centralized_makes_the_budget_in_stages_at_the_rounds_lr():
    """10 steps of batch 4 over 3 stages: 4 + 3 + 3 steps, full batches drawn from a pool of
    6 (the sampler passes over the pool again), a fresh optimizer each stage at round t's lr."""
    data = {f"u{i}": {"x": torch.full((1,), float(i))} for i in range(6)}
    dataset = sb.dataio.dataset.DynamicItemDataset(data, output_keys=["id", "x"])
    schedule = RoundCosineLR(lr=1.0, lr_min_ratio=0.1)
    brain = _Counting(
        modules={"lin": torch.nn.Linear(1, 1)}, hparams={"lr_schedule": schedule},
        run_opts={"device": "cpu"},
    )  # fmt: skip
    brain.seen = []
    hparams = {"number_of_rounds": 3, "batch_size": 4, "sampler_seed": 11, "seed": 1}
    losses = mls_central.train_centralized(brain, dataset, steps=10, hparams=hparams)
    assert len(losses) == 3 and brain.fresh == 3
    assert [n for _, n in brain.seen] == [4] * 10
    lrs = [lr for lr, _ in brain.seen]
    assert lrs == [schedule(1, 3)] * 4 + [schedule(2, 3)] * 3 + [schedule(3, 3)] * 3


def test_pooled_manifest_holds_every_client_row(tmp_path):
    paths = []
    for c, ids in enumerate((["a", "b"], ["c"])):
        path = tmp_path / f"client{c}.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["ID", "wav"])
            writer.writerows([[i, f"{i}.wav"] for i in ids])
        paths.append(path)
    out = tmp_path / "m" / "pooled.csv"
    assert mls_central.write_pooled_manifest(paths, out) == 3
    with open(out, newline="") as handle:
        assert [r["ID"] for r in csv.DictReader(handle)] == ["a", "b", "c"]

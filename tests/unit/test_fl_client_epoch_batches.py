"""One pass over a client's loader without torch's iterator object.

:func:`speechbrain_fl.fl.collation.epoch_batches` must yield exactly the batches torch's
single-process ``DataLoader`` iterator yields, in the same order, and leave every random
generator where the iterator leaves it (its base-seed draw included), or hand the loader back
where it does not reproduce the iterator.
"""

from __future__ import annotations

import pytest
import speechbrain as sb
import torch
from speechbrain.dataio.batch import PaddedBatch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from speechbrain_fl.fl.collation import epoch_batches, stacked_padded_batch
from speechbrain_fl.fl.toy import ToyBrain, _Examples


class _Plain(Dataset):
    """A map-style dataset without ``__getitems__``."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "i": torch.tensor([i])}


def _as_lists(batch):
    if isinstance(batch, PaddedBatch):  # every attribute: the padded data and lengths, the keys
        return {
            k: (v.data.tolist(), v.lengths.tolist()) if hasattr(v, "lengths") else v
            for k, v in vars(batch).items()
        }
    if isinstance(batch, dict):
        return {k: v.tolist() for k, v in batch.items()}
    return batch.tolist()


def _compare(loader, seed: int = 3, epochs: int = 2):
    """Batches and the global RNG state after each epoch: torch's iterator, then ours."""
    results = []
    for fast in (False, True):
        torch.manual_seed(seed)
        out = []
        for epoch in range(epochs):
            sampler = getattr(loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            batches = epoch_batches(loader) if fast else loader
            if fast:
                assert batches is not loader  # the fast path is the one under test
            out.append(([_as_lists(b) for b in batches], torch.get_rng_state()))
        results.append(out)
    (torch_run, our_run) = results
    for (tb, ts), (ob, os_) in zip(torch_run, our_run, strict=True):
        assert tb == ob
        assert torch.equal(ts, os_)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("getitems", [False, True])
def test_same_batches_and_draws_as_torchs_iterator(shuffle, drop_last, getitems):
    data = _Examples(torch.randn(70, 4), torch.randn(70, 1)) if getitems else _Plain(70)
    collate = stacked_padded_batch if getitems else None
    kwargs = {"collate_fn": collate} if collate else {}
    loader = DataLoader(data, batch_size=16, shuffle=shuffle, drop_last=drop_last, **kwargs)
    _compare(loader)


def test_speechbrains_loader_and_reproducible_sampler():
    """``Brain.make_dataloader`` with ``shuffle``: a SaveableDataLoader over SpeechBrain's
    ReproducibleRandomSampler, reseeded per epoch (``set_epoch``)."""
    brain = ToyBrain(
        modules={"model": torch.nn.Linear(4, 1)},
        opt_class=lambda p: torch.optim.SGD(p, lr=0.1),
        run_opts={"device": "cpu", "noprogressbar": True},
    )
    data = _Examples(torch.randn(64, 4), torch.randn(64, 1))
    loader = brain.make_dataloader(
        data, stage=sb.Stage.TRAIN, batch_size=16, shuffle=True, collate_fn=PaddedBatch
    )
    _compare(loader, epochs=3)


def test_a_generator_of_the_loader_is_drawn_from():
    gen = torch.Generator().manual_seed(5)
    loader = DataLoader(_Plain(20), batch_size=6, shuffle=True, generator=gen)
    gen.manual_seed(5)
    expected = [_as_lists(b) for b in loader]
    state = gen.get_state()
    gen.manual_seed(5)
    assert [_as_lists(b) for b in epoch_batches(loader)] == expected
    assert torch.equal(gen.get_state(), state)


class _OwnSampler(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6.0))


class _OwnIter(DataLoader):
    def __iter__(self):
        return super().__iter__()


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(_Plain(8), batch_size=2, sampler=_OwnSampler(8)),
        lambda: DataLoader(_Plain(8), batch_size=2, num_workers=1),
        lambda: DataLoader(_Plain(8), batch_size=2, pin_memory=True),
        lambda: DataLoader(_Plain(8), batch_size=None),
        lambda: DataLoader(_Stream(), batch_size=2),
        lambda: _OwnIter(_Plain(8), batch_size=2),
    ],
    ids=["custom-sampler", "workers", "pin-memory", "no-batching", "iterable", "own-iter"],
)
def test_other_loaders_are_iterated_by_torch(make):
    loader = make()
    assert epoch_batches(loader) is loader


def test_a_running_profiler_keeps_torchs_iterator():
    loader = DataLoader(_Plain(8), batch_size=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert epoch_batches(loader) is loader
    assert epoch_batches(loader) is not loader

"""DistributedSampler: the same indices as torch's for every argument combination, and shards
that split the dataset the way data parallelism needs."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchSampler

from course_lib.data import DistributedSampler

SIZES = [1, 2, 3, 5, 7, 8, 16, 17, 100]
WORLDS = [1, 2, 3, 4, 8]


def grid():
    for n, p, shuffle, drop_last in itertools.product(SIZES, WORLDS, [False, True],
                                                      [False, True]):
        if drop_last and n < p:
            continue  # torch yields nothing for every rank; ours refuses (tested below)
        yield n, p, shuffle, drop_last


@pytest.mark.parametrize("seed", [0, 7])
def test_same_indices_as_torch(seed):
    checked = 0
    for n, p, shuffle, drop_last in grid():
        data = range(n)
        for rank in range(p):
            ours = DistributedSampler(data, p, rank, shuffle=shuffle, seed=seed,
                                      drop_last=drop_last)
            theirs = TorchSampler(data, p, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            assert len(ours) == len(theirs), (n, p, rank, shuffle, drop_last)
            for epoch in (0, 1, 5):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (n, p, rank, shuffle, drop_last, epoch)
                checked += 1
    assert checked > 500


@pytest.mark.parametrize("n,p", [(10, 3), (16, 4), (17, 4), (5, 8), (100, 7)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_disjoint_when_dropping_and_covering_when_padding(n, p, shuffle):
    def shards(drop_last):
        return [list(DistributedSampler(range(n), p, r, shuffle=shuffle, seed=3,
                                        drop_last=drop_last)) for r in range(p)]

    padded = shards(drop_last=False)
    assert len({len(s) for s in padded}) == 1  # equal shard sizes: no rank waits on the others
    assert set(itertools.chain(*padded)) == set(range(n))  # every sample seen
    assert sum(map(len, padded)) - n < p  # padding repeats fewer than p samples
    if n >= p:
        dropped = shards(drop_last=True)
        flat = list(itertools.chain(*dropped))
        assert len(flat) == len(set(flat)) == n - n % p  # disjoint, only the tail dropped
        assert len({len(s) for s in dropped}) == 1


def test_epochs_reshuffle_identically_on_every_rank():
    a = DistributedSampler(range(50), 2, 0, seed=1)
    b = DistributedSampler(range(50), 2, 1, seed=1)
    e0 = list(a) + list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = list(a) + list(b)
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_replicas=2, rank=2), "invalid rank 2"),
    (dict(num_replicas=2, rank=-1), "invalid rank -1"),
    (dict(num_replicas=0, rank=0), "num_replicas must be a positive int"),
    (dict(num_replicas=-3, rank=0), "num_replicas must be a positive int"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(range(10), **kwargs)


def test_empty_dataset_and_drop_last_leaving_nothing():
    with pytest.raises(ValueError, match="empty"):
        DistributedSampler([], 2, 0)
    with pytest.raises(ValueError, match="leaves every rank empty"):
        DistributedSampler(range(3), 4, 0, drop_last=True)


class FakeDist:
    """A `dist`-like object standing in for an initialized process group."""

    def __init__(self, initialized=True):
        self.initialized = initialized

    def is_initialized(self):
        return self.initialized

    def get_world_size(self, group=None):
        return 3

    def get_rank(self, group=None):
        return 2


def test_world_and_rank_from_the_process_group():
    s = DistributedSampler(range(10), shuffle=False, dist=FakeDist())
    assert (s.num_replicas, s.rank, list(s)) == (3, 2, [2, 5, 8, 1])
    with pytest.raises(RuntimeError, match="initialize a process group"):
        DistributedSampler(range(10), dist=FakeDist(initialized=False))


def test_works_in_a_dataloader():
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    sampler = DistributedSampler(data, 2, 1, shuffle=False)
    batches = [b[0].tolist() for b in torch.utils.data.DataLoader(data, batch_size=2,
                                                                   sampler=sampler)]
    assert batches == [[1.0, 3.0], [5.0, 7.0], [9.0]]

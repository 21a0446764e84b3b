"""Lesson 03 (data sharding): the indices each rank reads, checked against torch's sampler."""

from __future__ import annotations

from course_lib.grading import Exercise, case, register


def _torch_indices(n: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                   drop_last: bool = False) -> list[int]:
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(range(n), num_replicas, rank, shuffle=shuffle, seed=seed,
                                   drop_last=drop_last))


register(Exercise(
    name="lesson03.shard_indices",
    notebook="03_data_sharding",
    params=("n", "num_replicas", "rank", "shuffle", "seed", "drop_last"),
    cases=[
        case(12, 3, 1, False, 0, False, label="12 samples, 3 ranks, rank 1, in order"),
        case(10, 4, 3, False, 0, False, label="10 on 4 ranks: pad by wrapping (rank 3)"),
        case(10, 4, 2, False, 0, True, label="10 on 4 ranks, drop_last (rank 2)"),
        case(3, 8, 7, False, 0, False, label="3 samples on 8 ranks: wrap more than once"),
        case(20, 3, 0, True, 5, False, label="shuffled, seed 5 (rank 0)"),
        case(20, 3, 2, True, 6, True, label="shuffled, seed 6, drop_last (rank 2)"),
    ],
    reference=_torch_indices,
    points=2,
    hints=("Shuffle with a torch.Generator seeded `seed` (torch.randperm), pad by repeating the "
          "list from its start (or cut it for drop_last) to a multiple of num_replicas, then "
          "take every num_replicas-th index starting at rank.",),
))

"""Lesson 03 (data sharding): the indices each rank reads, checked against torch's sampler."""

from __future__ import annotations

from course_lib.course.grading import Exercise, case, register

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
    reference="lesson03:shard_indices",
    explain="lesson03:explain_shard_indices",
    points=2,
    hints=("Three invariants: every rank starts from the same order of range(n) (torch's "
           "permutation for the seed, or the identity without shuffling), every rank gets the "
           "same number of indices (the order padded from its start, or its tail dropped), "
           "and the ranks take turns through that order.",
           "Write the padded order in one row and deal it out like cards, one to each rank in "
           "turn, rank 0 first. For 10 samples on 4 ranks the row is 0 1 2 3 4 5 6 7 8 9 0 1, "
           "and rank 3 is dealt 3, 7 and 1. With drop_last, deal only the full rounds."),
))

"""The capstone's data: the text as windows of ids (`TextWindows`), its last part held out for
validation (`split_text`), and each data-parallel rank's strided share of every step's global
batch (`batches`), so that the dp ranks of a step together read what one process would.
Importable from `course_lib.run` too.
"""

from __future__ import annotations

from typing import Iterator

import torch

from course_lib.data import DistributedSampler


class TextWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of block_size + 1 ids: (input, the input shifted by one)."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.ids[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def split_text(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training ids, validation ids): the last `val_fraction` of the text is held out."""
    n = len(ids) - int(len(ids) * val_fraction)
    return ids[:n], ids[n:]


def batches(dataset: TextWindows, per_rank: int, dp: int, dp_rank: int,
            seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's (x, y) for each step, forever: its strided share of the
    global batch, so the dp ranks of a step together read what one process would."""
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, seed=seed,
                                 drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order) - per_rank + 1, per_rank):
            xs, ys = zip(*(dataset[j] for j in order[i:i + per_rank]))
            yield torch.stack(xs), torch.stack(ys)
        epoch += 1

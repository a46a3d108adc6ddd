"""Which training rows each step reads, for any number of processes.

The rows form a stream of epochs, each a permutation seeded by (seed, epoch); global
step s reads positions [s * B, (s + 1) * B) of that stream (B rows, the global batch),
so every step is a full batch and its rows depend only on the seed and the step. (An
epoch counts ceil(rows / B) steps, so its last step takes the first rows of the next.)
With gradient accumulation over A micro-steps, micro-step m reads B / A of them, and
accelerate (``split_batches``) hands each of P processes its B / (A * P).

Why by hand: accelerate's seedable sampler reshuffles per epoch too, but a run
resumed mid-epoch would need ``skip_first_batches``, and it pads an epoch's short
last batch with rows of its first one when the batch is split across processes, so
a 1-process and a 2-process run would see different rows. Here they see the same
global batches, and a resumed run starts at its micro-step with nothing to skip.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class StepBatches:
    """Row indices of micro-steps ``start`` .. ``stop - 1``, ``batch_size`` rows each
    (a batch sampler for ``torch.utils.data.DataLoader``)."""

    def __init__(self, count: int, batch_size: int, seed: int, start: int, stop: int) -> None:
        if count < 1:
            raise ValueError("there are no training rows")
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.start, self.stop = start, stop

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __iter__(self) -> Iterator[list[int]]:
        orders: dict[int, torch.Tensor] = {}
        for micro_step in range(self.start, self.stop):
            positions = torch.arange(micro_step * self.batch_size, (micro_step + 1) * self.batch_size)  # (b,)
            epochs, offsets = positions // self.count, positions % self.count  # (b,) each
            rows = torch.empty_like(positions)
            for epoch in epochs.unique().tolist():
                if epoch not in orders:
                    orders = {e: o for e, o in orders.items() if e >= epoch - 1}  # keep the recent ones
                    generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                    orders[epoch] = torch.randperm(self.count, generator=generator)
                here = epochs == epoch
                rows[here] = orders[epoch][offsets[here]]
            yield rows.tolist()


class Rows(torch.utils.data.Dataset):
    """Training rows as tensors with the same first dimension; a batch is one indexing
    per tensor (``__getitems__``), not one item per row collated again."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows
        self.count = len(next(iter(rows.values())))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return {key: value[index] for key, value in self.rows.items()}


def whole_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DataLoader's collate function: :meth:`Rows.__getitems__` already built the batch."""
    return batch

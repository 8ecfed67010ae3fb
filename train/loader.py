"""Which sequence each worker trains on: a pure function of (seed, epoch, global sample index).

Sample ``g`` (counted from the start of the run, across epochs) is row
``permutation(seed, epoch)[g % n]`` with ``epoch = g // n``. Optimizer step ``s`` consumes
samples ``[s * global_batch, (s + 1) * global_batch)``; the worker count only decides who
computes which of them, so a run resumed at any size trains on exactly the same samples.
"""

import numpy as np


class SampleOrder:
    def __init__(self, num_rows: int, seed: int):
        if num_rows < 1:
            raise ValueError("the training split is empty")
        self.num_rows = num_rows
        self.seed = seed
        self._epoch = -1
        self._permutation = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """``Generator.permutation(num_rows)`` of the epoch's seed: its shuffle of ``arange(num_rows)``, here in
        32 bits where the rows fit (400 MB, not 800, a worker at 100M rows), which draws the same order."""
        if epoch != self._epoch:  # one epoch's permutation is cached; steps walk epochs in order
            self._permutation = np.arange(self.num_rows, dtype=np.int32 if self.num_rows < 2**31 else np.int64)
            np.random.default_rng([self.seed, epoch]).shuffle(self._permutation)
            self._epoch = epoch
        return self._permutation

    def rows(self, sample_indices: range) -> np.ndarray:
        """Dataset rows of the global sample indices (which may cross an epoch boundary)."""
        return np.array(
            [self.permutation(g // self.num_rows)[g % self.num_rows] for g in sample_indices], dtype=np.int64
        )


def micro_batch_samples(
    step: int, micro_step: int, rank: int, world_size: int, global_batch: int, micro_batch: int
) -> range:
    """Global sample indices of one worker's micro batch within optimizer step ``step``."""
    start = step * global_batch + (micro_step * world_size + rank) * micro_batch
    return range(start, start + micro_batch)

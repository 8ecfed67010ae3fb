"""Elastic batch math: a fixed global batch split over any world size in [min, max].

The global batch never changes when workers come and go; the gradient-accumulation
count is recomputed instead, so every optimizer step averages the same number of
samples whatever the world size.
"""

import math


def grad_accum_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that micro_batch * world_size * steps == global_batch."""
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(
            f"optim.global_batch_size={global_batch} is not divisible by "
            f"optim.micro_batch_size ({micro_batch}) x {world_size} workers"
        )
    return global_batch // per_step


def failing_world_sizes(global_batch: int, micro_batch: int, min_workers: int, max_workers: int) -> list[int]:
    return [w for w in range(min_workers, max_workers + 1) if global_batch % (micro_batch * w)]


def nearest_valid_global_batches(global_batch: int, micro_batch: int, min_workers: int, max_workers: int) -> list[int]:
    """The valid global batch sizes just below and above ``global_batch`` (one if it is the smallest)."""
    step = micro_batch * math.lcm(*range(min_workers, max_workers + 1))
    below = (global_batch // step) * step
    candidates = [below, below + step]
    return [b for b in candidates if b > 0]


def check_batch_divides(global_batch: int, micro_batch: int, min_workers: int, max_workers: int) -> None:
    """Raise a ValueError naming the world sizes that fail and the nearest valid global batches."""
    failing = failing_world_sizes(global_batch, micro_batch, min_workers, max_workers)
    if failing:
        suggestions = " or ".join(
            str(b) for b in nearest_valid_global_batches(global_batch, micro_batch, min_workers, max_workers)
        )
        raise ValueError(
            f"optim.global_batch_size={global_batch} with optim.micro_batch_size={micro_batch} cannot be "
            f"split evenly over {failing} workers (scaling.num_workers allows {min_workers}..{max_workers}); "
            f"use optim.global_batch_size {suggestions}, or change the micro batch or worker range"
        )

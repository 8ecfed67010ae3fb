"""Learning rate as a pure function of the step: linear warmup, then cosine decay.

Being stateless, the schedule resumes exactly from the step count alone.
"""

import math

from train.config import OptimConfig


def lr_at(step: int, optim: OptimConfig) -> float:
    """Learning rate for the update that takes the model from ``step`` to ``step + 1``."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, optim.max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

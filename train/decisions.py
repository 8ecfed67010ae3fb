"""What the training loop does after each step (evaluate, checkpoint and why), decided alike on every rank.

A decision that leads ranks into collectives must be the same on every rank, or they wait in different
collectives until the timeout. Step counts are the same everywhere, and Ray Train's
``get_preemption_info`` agrees one value across the workers (every worker calls it at the same steps);
only clocks differ. So rank 0's clock and timings are broadcast, in one collective, on the steps where a
clock can decide something (time-based checkpoints, a pre-emption deadline), and ``StepPolicy`` decides
from inputs that are identical on every rank.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.config import TrainConfig


@dataclass(frozen=True)
class Clock:
    """Rank 0's view of time (seconds), the same on every rank after ``rank0_clock``."""

    now: float
    last_save: float  # when the last checkpoint (or the run) ended
    step_seconds: float  # of the latest step
    save_seconds: float  # of the latest checkpoint


def rank0_clock(mine: Clock, device: torch.device) -> Clock:
    """Rank 0's clock on every rank (a collective)."""
    values = torch.tensor([mine.now, mine.last_save, mine.step_seconds, mine.save_seconds], dtype=torch.float64)
    values = values.to(device)
    dist.broadcast(values, src=0)
    return Clock(*values.tolist())


@dataclass(frozen=True)
class Notice:
    """A pre-emption notice: a node of the run is being reclaimed."""

    deadline: float | None  # seconds since the epoch; None when the notice gives none


@dataclass(frozen=True)
class Decision:
    evaluate: bool
    checkpoint: str  # why to checkpoint after this step: final, steps, minutes, preemption, deadline; "" = none


class StepPolicy:
    """The schedule of evaluations and checkpoints, and the reaction to a pre-emption notice.

    A notice gets a just-in-time checkpoint at once and, if it has a deadline, a last one shortly before
    it (two checkpoint durations plus three steps plus a second), so the steps trained meanwhile are kept.
    """

    def __init__(self, cfg: TrainConfig):
        self.eval_every = cfg.run.eval_every
        self.max_steps = cfg.optim.max_steps
        self.every_steps = cfg.checkpoint.every_steps
        self.every_seconds = 60 * cfg.checkpoint.every_minutes
        self.notice_seen = False
        self.deadline: float | None = None  # of the pre-emption notice, until the last checkpoint before it

    def needs_clock(self) -> bool:
        """Whether this step's decision may depend on the time (then pass ``rank0_clock`` to ``decide``)."""
        return self.every_seconds > 0 or self.deadline is not None

    def decide(self, step: int, notice: Notice | None, clock: Clock | None) -> Decision:
        """The decision after ``step``, given a pre-emption notice seen at this step, if any."""
        evaluate = step % self.eval_every == 0 or step == self.max_steps
        return Decision(evaluate, self._checkpoint_reason(step, notice, clock))

    def _checkpoint_reason(self, step: int, notice: Notice | None, clock: Clock | None) -> str:
        if notice is not None and not self.notice_seen:
            self.notice_seen, self.deadline = True, notice.deadline
            return "preemption"
        if self.deadline is not None:
            margin = 2 * clock.save_seconds + 3 * clock.step_seconds + 1.0
            if clock.now >= self.deadline - margin:
                self.deadline = None
                return "deadline"
        if step == self.max_steps:
            return "final"
        if self.every_steps and step % self.every_steps == 0:
            return "steps"
        if self.every_seconds and clock.now - clock.last_save >= self.every_seconds:
            return "minutes"
        return ""

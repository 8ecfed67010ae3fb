"""What the training loop does after each step (evaluate, checkpoint and why, wait for a restart), decided alike
on every rank.

A decision that leads ranks into collectives must be the same on every rank, or they wait in different
collectives until the timeout. Step counts are the same everywhere, and Ray Train's
``get_preemption_info`` agrees one value across the workers (every worker calls it at the same steps);
only clocks differ, and what rank 0 alone reads (an early-checkpoint request). So rank 0's view is
broadcast, in one collective, on the steps where it can decide something (pre-emption polls, which
time-based checkpoints ride along, and every step while a pre-emption deadline nears), and
``StepPolicy`` decides from inputs identical on every rank.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.config import TrainConfig

# How long past a restart's due time (a pre-emption deadline, or the grow's checkpoint) a run waits for it before
# it trains on: longer than the scaling policy's GROW_CHECKPOINT_WAIT_S, after which it grows whether or not the
# run said it waits.
RESTART_WAIT_S = 90.0


@dataclass(frozen=True)
class Rank0View:
    """What rank 0 saw (times in seconds), the same on every rank after ``share_rank0_view``."""

    now: float
    last_save: float  # when the last checkpoint (or the run) ended
    step_seconds: float  # of the latest step
    save_seconds: float  # of the latest checkpoint
    checkpoint_requested: float = 0.0  # time of the latest early-checkpoint request (train/early_checkpoint.py)
    # Requests up to this time are answered: by the latest checkpoint, or, before this attempt made one,
    # by the checkpoint it resumed from (a request between that checkpoint and the restart still counts).
    answered_until: float = 0.0
    # Time of a request (made during this attempt; else 0) for a checkpoint the run is about to be restarted from.
    restart_requested: float = 0.0


def share_rank0_view(mine: Rank0View, device: torch.device) -> Rank0View:
    """Rank 0's view on every rank (a collective)."""
    fields = [mine.now, mine.last_save, mine.step_seconds, mine.save_seconds, mine.checkpoint_requested]
    fields += [mine.answered_until, mine.restart_requested]
    values = torch.tensor(fields, dtype=torch.float64).to(device)
    dist.broadcast(values, src=0)
    return Rank0View(*values.tolist())


@dataclass(frozen=True)
class Notice:
    """A pre-emption notice: a node of the run is being reclaimed."""

    deadline: float | None  # seconds since the epoch; None when the notice gives none


@dataclass(frozen=True)
class Decision:
    evaluate: bool
    checkpoint: str  # why: final, steps, minutes, preemption, deadline, requested; "" = no checkpoint
    # Ray Train is about to restart the run from its newest checkpoint (past a pre-emption deadline, or for a
    # grow): once this step's checkpoint counts, wait up to this many seconds for the restart rather than train
    # steps it would redo (0: train on).
    restart_wait_s: float = 0.0


class StepPolicy:
    """The schedule of evaluations and checkpoints, and the reaction to a pre-emption notice.

    A notice gets a just-in-time checkpoint at once and, if it has a deadline, a last one shortly before
    it (two checkpoint durations plus three steps plus a second), so the steps trained meanwhile are kept.
    Ray Train restarts the run at the deadline, and a grow restarts it from the checkpoint the scaling policy
    asked for, taken at the step that reads the request: after either checkpoint the run waits for the
    restart, up to ``RESTART_WAIT_S`` past it.
    """

    def __init__(self, cfg: TrainConfig):
        self.eval_every = cfg.run.eval_every
        self.max_steps = cfg.optim.max_steps
        self.every_steps = cfg.checkpoint.every_steps
        self.every_seconds = 60 * cfg.checkpoint.every_minutes
        self.notice_seen = False
        self.deadline: float | None = None  # of the pre-emption notice, until the last checkpoint before it
        self.restart_awaited = 0.0  # the time of the latest restart request decided on

    def needs_view(self) -> bool:
        """Whether every step's decision depends on the time (then pass ``share_rank0_view`` to ``decide``).

        Only a pre-emption deadline needs it; time-based checkpoints are decided on the steps that get
        a view anyway (pre-emption polls, every few seconds), which a schedule in minutes does not notice.
        """
        return self.deadline is not None

    def decide(self, step: int, notice: Notice | None, view: Rank0View | None) -> Decision:
        """The decision after ``step``, given a pre-emption notice seen at this step, if any."""
        evaluate = step % self.eval_every == 0 or step == self.max_steps
        deadline = self.deadline
        reason = self._checkpoint_reason(step, notice, view)
        restart_wait = 0.0
        if view is not None and step < self.max_steps:  # at the last step the run ends anyway, after its export
            if reason == "deadline":
                restart_wait = deadline - view.now + RESTART_WAIT_S
            if view.restart_requested > self.restart_awaited:
                # A checkpoint of this step, even where an earlier one answered the request: the run waits here.
                self.restart_awaited = view.restart_requested
                reason = reason or "requested"
                restart_wait = max(restart_wait, RESTART_WAIT_S)
        return Decision(evaluate, reason, restart_wait)

    def _checkpoint_reason(self, step: int, notice: Notice | None, view: Rank0View | None) -> str:
        if notice is not None and not self.notice_seen:
            self.notice_seen, self.deadline = True, notice.deadline
            return "preemption"
        if self.deadline is not None:
            margin = 2 * view.save_seconds + 3 * view.step_seconds + 1.0
            if view.now >= self.deadline - margin:
                self.deadline = None
                return "deadline"
        if view is not None and view.checkpoint_requested > view.answered_until:
            return "requested"
        if step == self.max_steps:
            return "final"
        if self.every_steps and step % self.every_steps == 0:
            return "steps"
        if self.every_seconds and view is not None and view.now - view.last_save >= self.every_seconds:
            return "minutes"
        return ""

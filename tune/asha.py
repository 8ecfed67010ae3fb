"""ASHA's rungs kept with a sweep's saved state, so that a resumed sweep stops trials as the sweep would have.

Tune saves the searcher's state and its callbacks' with each experiment checkpoint and restores them on
``--resume``, but not the scheduler's: a resumed sweep's ASHA would start with empty rungs. The first trial
to reach a rung after the resume would pass it whatever its loss, and the trials after it would be
measured against the few results since. ``AshaRungs`` is a callback that saves the rungs with the
rest of the sweep's state and puts them back into the scheduler on resume.
"""

from ray.tune import Callback
from ray.tune.schedulers import AsyncHyperBandScheduler


class AshaRungs(Callback):
    """Saves and restores ``scheduler``'s rungs (the loss of each trial at each rung it reached).

    Tune pickles a sweep's scheduler and callbacks together when the sweep starts and restores both from
    that one pickle, so the restored callback holds the restored scheduler.
    """

    def __init__(self, scheduler: AsyncHyperBandScheduler):
        self.scheduler = scheduler

    def get_state(self) -> dict:
        # Ray's ASHA keeps its rungs in private fields (ray 2.60: brackets of (milestone, {trial id: value})).
        brackets = [[(milestone, dict(recorded)) for milestone, recorded in b._rungs] for b in self.scheduler._brackets]
        return {"brackets": brackets, "num_stopped": self.scheduler._num_stopped}

    def set_state(self, state: dict) -> None:
        # In place: the restored trials' entries in the scheduler point at these brackets.
        for bracket, saved in zip(self.scheduler._brackets, state["brackets"], strict=True):
            for (milestone, recorded), (saved_milestone, values) in zip(bracket._rungs, saved, strict=True):
                if milestone != saved_milestone:
                    raise ValueError(
                        f"ASHA's rungs changed since the sweep was saved: {milestone} vs {saved_milestone}"
                    )
                recorded.clear()
                recorded.update(values)
        self.scheduler._num_stopped = state["num_stopped"]

"""The sweep's searcher: Optuna's TPE, told what ASHA did to each trial.

Ray's ``OptunaSearch`` reports a trial's evaluations to Optuna by report count and tells Optuna that
a trial ASHA stopped is complete, with the loss it had when stopped: TPE then takes an early loss
for a final one and learns to avoid configurations that start slowly. Here evaluations are reported
at their training step, and a trial stopped before the last step is told as pruned, which TPE ranks
below the complete ones by how far it got and its loss there (Optuna's own handling of pruned trials).
"""

from typing import Any

import optuna
from ray.tune.search.optuna import OptunaSearch


class StepAwareOptunaSearch(OptunaSearch):
    """``OptunaSearch`` for trials that report ``step`` and train ``max_steps`` unless stopped."""

    def __init__(self, *, max_steps: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.max_steps = max_steps

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id not in self._completed_trials:
            self._ot_trials[trial_id].report(result[self.metric], result["step"])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        stopped_early = not error and result is not None and result.get("step", self.max_steps) < self.max_steps
        if not stopped_early or trial_id in self._completed_trials:
            super().on_trial_complete(trial_id, result, error)
            return
        self._ot_study.tell(self._ot_trials[trial_id], state=optuna.trial.TrialState.PRUNED)
        self._completed_trials.add(trial_id)

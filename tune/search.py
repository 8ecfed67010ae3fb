"""The sweep's searcher: Optuna's TPE, told what ASHA did to each trial, exploring as it exploits.

Ray's ``OptunaSearch`` reports a trial's evaluations to Optuna by report count and tells Optuna that
a trial ASHA stopped is complete, with the loss it had when stopped: TPE then takes an early loss
for a final one and learns to avoid configurations that start slowly. Here evaluations are reported
at their training step, and a trial stopped before the last step is told as pruned, which TPE ranks
below the complete ones by how far it got and its loss there (Optuna's own handling of pruned trials).

TPE alone tends to lock on the region of the first trials that did well: with ASHA finishing only a
few trials, its "good" set is two or three of them. Like BOHB, a fixed fraction of the proposals is
drawn at random instead, so a sweep keeps finding regions its first trials missed.
"""

from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import TPESampler
from optuna.study import Study
from optuna.trial import FrozenTrial
from ray.tune.search.optuna import OptunaSearch


class ExploringTPESampler(TPESampler):
    """TPE whose trials number n with ⌊(n+1)·random_fraction⌋ > ⌊n·random_fraction⌋ are drawn at random
    (every third one for 1/3): by trial number, so a restored study draws the same."""

    def __init__(self, *, random_fraction: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.random_fraction = random_fraction

    def explores(self, trial: FrozenTrial) -> bool:
        return int((trial.number + 1) * self.random_fraction) > int(trial.number * self.random_fraction)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {} if self.explores(trial) else super().infer_relative_search_space(study, trial)

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        if self.explores(trial):  # TPE's own seeded random sampler, the one it uses for its start-up trials
            return self._random_sampler.sample_independent(study, trial, param_name, param_distribution)
        return super().sample_independent(study, trial, param_name, param_distribution)


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

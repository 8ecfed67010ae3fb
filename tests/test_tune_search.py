"""The sweep's searcher with real Optuna: what TPE learns from stopped trials, its random share, and its
state across a restore."""

import optuna
import pytest

from train.schema import ConfigError
from tune.config import sweep_config_from_dict
from tune.search import ExploringTPESampler, StepAwareOptunaSearch
from tune.sweep import tune_space

pytestmark = pytest.mark.unit

SPACE = {"optim.lr": {"loguniform": [1e-4, 3e-2]}, "model.d_model": {"choice": [64, 128]}}


def searcher(seed: int = 0) -> StepAwareOptunaSearch:
    sampler = ExploringTPESampler(
        random_fraction=1 / 3, seed=seed, n_startup_trials=2, multivariate=True, constant_liar=True
    )
    search = StepAwareOptunaSearch(metric="val_loss", mode="min", sampler=sampler, max_steps=60)
    search.set_search_properties(None, None, tune_space(SPACE))  # as the Tuner hands it its param_space
    return search


def run_trials(search: StepAwareOptunaSearch, first: int, count: int) -> list[dict]:
    """Propose, evaluate and finish ``count`` trials; every other one is stopped at step 20."""
    proposals = []
    for index in range(first, first + count):
        trial_id = f"t{index}"
        proposals.append(search.suggest(trial_id))
        last_step = 20 if index % 2 else 60
        for step in range(10, last_step + 1, 10):
            search.on_trial_result(trial_id, {"step": step, "val_loss": 5.0 - step / 100 - index / 1000})
        search.on_trial_complete(trial_id, {"step": last_step, "val_loss": 5.0 - last_step / 100})
    return proposals


def test_a_stopped_trial_is_pruned_for_tpe_with_its_evaluations_at_their_steps():
    search = searcher()
    run_trials(search, 0, 2)
    complete, stopped = search._ot_study.trials
    assert complete.state == optuna.trial.TrialState.COMPLETE and complete.value == pytest.approx(4.4)
    assert stopped.state == optuna.trial.TrialState.PRUNED
    assert sorted(stopped.intermediate_values) == [10, 20]  # training steps, not report counts
    assert stopped.value == stopped.intermediate_values[20]  # Optuna's value of a pruned trial: its last


def test_a_restored_searcher_proposes_what_an_uninterrupted_one_would(tmp_path):
    uninterrupted, interrupted = searcher(), searcher()
    run_trials(uninterrupted, 0, 5)
    run_trials(interrupted, 0, 5)
    interrupted.save(str(tmp_path / "searcher.pkl"))
    restored = searcher(seed=99)  # a fresh driver: its own sampler state is replaced by the saved one
    restored.restore(str(tmp_path / "searcher.pkl"))
    assert run_trials(restored, 5, 4) == run_trials(uninterrupted, 5, 4)


def test_a_third_of_tpe_proposals_are_random_so_it_does_not_lock_on_its_first_good_region():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = ExploringTPESampler(random_fraction=1 / 3, seed=0, n_startup_trials=5, multivariate=True)
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1) ** 2, n_trials=50)
    after_startup = study.trials[5:]
    explored = [t.params["x"] for t in after_startup if sampler.explores(t)]
    exploited = [t.params["x"] for t in after_startup if not sampler.explores(t)]
    assert len(explored) == 15  # trials 5, 8, 11, ...: every third
    # TPE homes in on x near 0; the random third keeps covering the whole range.
    assert sorted(exploited)[len(exploited) // 2] < 0.1 < 0.3 < sorted(explored)[len(explored) // 2]
    assert max(explored) > 0.8


def test_asha_may_not_judge_trials_before_their_warmup_ends():
    space = {"optim.warmup_steps": {"int": [0, 30]}}
    with pytest.raises(ConfigError, match="grace_period: 10 steps .* up to 30"):
        sweep_config_from_dict({"base": "tiny", "space": space, "grace_period": 10})
    sweep_config_from_dict({"base": "tiny", "space": space, "grace_period": 30})
    sweep_config_from_dict({"base": "tiny", "space": space, "grace_period": 10, "early_stopping": "none"})


def test_asha_needs_a_first_rung_before_the_last_step():
    with pytest.raises(ConfigError, match="grace_period: 100 steps is not below optim.max_steps"):
        sweep_config_from_dict({"base": "tiny", "space": SPACE, "grace_period": 100})

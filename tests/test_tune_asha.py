"""ASHA's rungs survive a resumed sweep: the resumed sweep stops a trial that the uninterrupted one would stop."""

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray import tune
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from tune.asha import AshaRungs

# Rungs at steps 10 and 30 of 30.
ASHA = {"time_attr": "step", "metric": "val_loss", "mode": "min", "max_t": 30, "grace_period": 10}


def _asha() -> ASHAScheduler:
    return ASHAScheduler(**ASHA, reduction_factor=3, stop_last_trials=False)


def _report(scheduler: ASHAScheduler, trial_id: str, step: int, loss: float) -> str:
    trial = SimpleNamespace(trial_id=trial_id)  # what ASHA reads of a trial
    if trial_id not in scheduler._trial_info:
        scheduler.on_trial_add(None, trial)
    return scheduler.on_trial_result(None, trial, {"step": step, "val_loss": loss})


@pytest.mark.unit
def test_the_saved_rungs_give_a_restored_scheduler_the_same_decisions():
    scheduler = _asha()
    saved = AshaRungs(scheduler)
    for trial_id, loss in (("a", 1.0), ("b", 2.0)):
        _report(scheduler, trial_id, 10, loss)
    # As Tune restores a sweep: scheduler and callback from the pickle made at its start, then the state.
    restored = pickle.loads(pickle.dumps(AshaRungs(_asha())))
    restored.set_state(pickle.loads(pickle.dumps(saved.get_state())))
    assert _report(restored.scheduler, "c", 10, 3.0) == _report(scheduler, "c", 10, 3.0) == TrialScheduler.STOP
    assert _report(_asha(), "c", 10, 3.0) == TrialScheduler.CONTINUE  # what an empty rung does
    assert restored.scheduler._num_stopped == scheduler._num_stopped == 2  # b at the rung, then c


@pytest.mark.unit
def test_rungs_saved_for_other_milestones_are_refused():
    state = AshaRungs(_asha()).get_state()
    other = AshaRungs(ASHAScheduler(**{**ASHA, "grace_period": 5}, reduction_factor=3, stop_last_trials=False))
    with pytest.raises(ValueError, match="rungs changed"):
        other.set_state(state)


def _trainable_interrupted_while(marker: Path):
    """Three evaluations; the trial of loss 3 fails before its first while ``marker`` exists. A closure:
    Tune's workers cannot import this test module."""

    def trainable(config: dict) -> None:
        if config["loss"] == 3.0 and marker.exists():
            raise RuntimeError("interrupted")
        for step in (10, 20, 30):
            tune.report({"step": step, "val_loss": config["loss"] + 1 / step})

    return trainable


@pytest.mark.cluster
def test_a_trial_resumed_with_its_sweep_is_measured_against_the_rungs_from_before(ray_session, tmp_path):
    """Trials of loss 1 and 2 reach the first rung; the one of loss 3 fails before it. Resumed (`--resume`
    resumes failed trials), that trial is stopped at the rung by the two results from before the resume;
    with an empty rung it would have run to the end."""
    marker = tmp_path / "interrupted"
    marker.touch()
    trainable, scheduler = _trainable_interrupted_while(marker), _asha()
    tuner = tune.Tuner(
        trainable,
        param_space={"loss": tune.grid_search([1.0, 2.0, 3.0])},
        tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=1),
        run_config=tune.RunConfig(name="asha", storage_path=str(tmp_path), callbacks=[AshaRungs(scheduler)]),
    )
    first = tuner.fit()
    assert {r.config["loss"]: r.metrics.get("step") for r in first} == {1.0: 30, 2.0: 10, 3.0: None}
    marker.unlink()
    resumed = tune.Tuner.restore(str(tmp_path / "asha"), trainable=trainable, resume_errored=True).fit()
    assert {r.config["loss"]: r.metrics["step"] for r in resumed} == {1.0: 30, 2.0: 10, 3.0: 10}

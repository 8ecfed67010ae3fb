import json

import pytest
import ray

from train.schema import ConfigError
from train.timeline import (
    TIMELINE,
    CheckpointEvent,
    Startup,
    Timeline,
    describe_resize,
    node_price_type,
    read_saved_state,
    summarize,
)

# A timeline.json as raywright wrote it before its records were typed (2026-12-05): a node lost at step 6 of 2
# workers on spot nodes, resumed from step 4's checkpoint on 1 worker; the driver then died after step 8.
SAVED_BEFORE = {
    "attempts": [
        {"world_size": 2, "node_ids": ["a", "b"], "node_types": {"a": "spot", "b": "spot"}, "resumed_step": 0,
         "start": 100.0, "last_step": 6, "last_step_end": 160.0, "end": 165.0, "preempted": False, "resize": None},
        {"world_size": 1, "node_ids": ["a"], "node_types": {"a": "spot"}, "resumed_step": 4, "start": 165.0,
         "last_step": 8, "last_step_end": 210.0, "end": 0.0, "preempted": False,
         "resize": {"from": 2, "to": 1, "reason": "node lost", "steps_redone": 2, "at_step": 4, "workers_up_s": 10.0,
                    "data_s": 1.0, "convert_s": 2.0, "engine_s": 3.0, "load_s": 1.0, "seconds_lost": 20.0}},
    ],
    "step_seconds": {str(step): 10.0 for step in range(1, 9)},
    "checkpoints": [{"step": 4, "reason": "steps", "time": 150.0}],
    "finished": 0.0,
}  # fmt: skip


@pytest.mark.unit
def test_node_price_type_is_the_first_priced_resource():
    prices = {"spot": 1.0, "ondemand": 3.0}
    assert node_price_type({"CPU": 8, "spot": 1}, prices, "ondemand") == "spot"
    assert node_price_type({"CPU": 8}, prices, "ondemand") == "ondemand"


@pytest.mark.unit
def test_a_record_saved_before_it_was_typed_is_continued_and_an_edited_one_is_named(tmp_path):
    (tmp_path / TIMELINE).write_text(json.dumps(SAVED_BEFORE))
    state = read_saved_state(str(tmp_path))
    summary = summarize(state, {"spot": 1.0, "ondemand": 3.0}, "ondemand")
    assert describe_resize(summary.resizes[0]) == (
        "resize 2 -> 1 workers (node lost): 20.0 s lost "
        "(workers up 10.0 s, data 1.0 s, convert 2.0 s, engine 3.0 s, load 1.0 s), 2 steps redone"
    )
    assert (summary.restarts, summary.steps_redone, summary.step_s, summary.wall_s) == (1, 2, 80.0, 110.0)
    assert summary.node_hours == {"spot": pytest.approx((2 * 65.0 + 45.0) / 3600)}
    assert summary.cost == pytest.approx(summary.cost_on_demand_only / 3)
    assert state.model_validate_json(state.model_dump_json(exclude_none=True)) == state  # what this version saves

    (tmp_path / TIMELINE).write_text(json.dumps({**SAVED_BEFORE, "checkpoints": [{"step": 4, "reason": "steps"}]}))
    with pytest.raises(ConfigError) as unreadable:
        read_saved_state(str(tmp_path))
    assert str(unreadable.value) == (
        f"{tmp_path / TIMELINE} is not a run timeline this raywright reads (checkpoints.0.time: required)"
    )


@pytest.mark.cluster
def test_resizes_redone_steps_goodput_and_cost(ray_session, monkeypatch):
    node = ray.get_runtime_context().get_node_id()
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr("train.timeline.time.time", lambda: float(next(clock)))
    timeline = Timeline({"ondemand": 3.0}, "ondemand")

    timeline.attempt_started(3, [node] * 3, resumed_step=0)  # t=0
    for step in (1, 2, 3):
        timeline.step_done(step, seconds=10.0, end=10.0 * step)
    startup = Startup(entered=42.0, data_s=1.0, convert_s=4.0, engine_s=2.0, load_s=1.0)
    timeline.attempt_started(2, [node] * 2, resumed_step=2, startup=startup)  # node lost; step 3 is redone
    timeline.step_done(3, seconds=10.0, end=60.0)
    timeline.preemption_notice()
    timeline.checkpoint_saved(3, "preemption")
    resumed = CheckpointEvent(step=3, reason="x", time=1.0)
    timeline.attempt_started(2, [node] * 2, resumed_step=3, resumed_checkpoint=resumed)
    timeline.step_done(4, seconds=10.0, end=90.0)
    # A checkpoint whose record its attempt, stopped right after it counted, never sent: the next attempt's.
    lost = CheckpointEvent(step=4, reason="requested", time=95.0)
    timeline.attempt_started(3, [node] * 3, resumed_step=4, resumed_checkpoint=lost)
    timeline.finished()

    summary = timeline.summary()
    assert [(r.from_workers, r.to_workers, r.reason, r.steps_redone) for r in summary.resizes] == [
        (3, 2, "node lost", 1),
        (2, 2, "preemption", 0),
        (2, 3, "capacity returned", 0),
    ]
    # From the end of the last step before (t=30) to the start of the first one after (t=60-10).
    assert summary.resizes[0].seconds_lost == pytest.approx(20.0)
    # Where they went: 12 s until the new workers ran (t=30 -> 42), then the phases of the start.
    assert describe_resize(summary.resizes[0]) == (
        "resize 3 -> 2 workers (node lost): 20.0 s lost "
        "(workers up 12.0 s, data 1.0 s, convert 4.0 s, engine 2.0 s, load 1.0 s), 1 steps redone"
    )
    assert summary.restarts == 3 and summary.steps_redone == 1
    assert summary.step_s == 40.0  # steps 1-4 once each; the first run of step 3 does not count
    assert summary.goodput == pytest.approx(40.0 / summary.wall_s)
    assert summary.cost == pytest.approx(summary.cost_on_demand_only)  # the head node has no "spot"
    assert [(c.step, c.reason) for c in summary.checkpoints] == [(3, "preemption"), (4, "requested")]
    assert summary.checkpoints[-1] == lost


@pytest.mark.cluster
def test_a_resuming_driver_continues_the_record_of_the_run(ray_session, monkeypatch, tmp_path):
    node = ray.get_runtime_context().get_node_id()
    now = [0.0]
    monkeypatch.setattr("train.timeline.time.time", lambda: now[0])

    def driver(resumed_step: int, steps: range) -> Timeline:
        """A driver's timeline, continuing what the run's directory holds; it trains ``steps``, 10 s each."""
        saved = read_saved_state(str(tmp_path))
        timeline = Timeline({}, "ondemand", str(tmp_path), saved, save_every_s=25.0)
        timeline.attempt_started(2, [node] * 2, resumed_step=resumed_step, startup=Startup(entered=now[0] + 5.0))
        now[0] += 5.0
        for step in steps:
            now[0] += 10.0
            timeline.step_done(step, seconds=10.0, end=now[0])
            if step == 2:
                timeline.checkpoint_saved(2, "interval")
        return timeline

    # The first driver dies after step 6: its record was last saved after step 5 (saves 25 s apart, and at step 2's
    # checkpoint), so step 6 is not known to the next driver.
    driver(0, range(1, 7))
    now[0] += 100.0  # until the job is submitted again
    second = driver(2, range(3, 9))
    second.finished()
    summary = second.summary()
    assert [(r.from_workers, r.to_workers, r.reason, r.steps_redone) for r in summary.resizes] == [
        (2, 2, "driver lost", 3)
    ]
    # From step 5's end (t=55) until the next driver started (t=165), then until its workers ran (t=170).
    assert describe_resize(summary.resizes[0]) == (
        "resize 2 -> 2 workers (driver lost): 115.0 s lost (driver gone 110.0 s, workers up 5.0 s), 3 steps redone"
    )
    assert summary.step_s == 80.0  # steps 1-8 once each
    assert summary.wall_s == pytest.approx(65.0 + 100.0 + 65.0)  # the gap while no driver ran counts
    assert summary.restarts == 1

    # Trained on a day after it finished (max_steps raised): a segment of its own; the day is not wall time.
    now[0] += 86_400.0
    third = driver(8, range(9, 11))
    third.finished()
    summary = third.summary()
    assert summary.restarts == 1 and summary.step_s == 100.0
    assert summary.wall_s == pytest.approx(230.0 + 25.0)
    assert [entry.from_step for entry in summary.world_size_timeline] == [0, 2, 8]

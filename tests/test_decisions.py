"""The per-step decisions of the training loop: plain policies, and the same answer on every rank."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.conftest import on_ranks
from train.config import load_config
from train.decisions import RESTART_WAIT_S, Notice, Rank0View, StepPolicy, share_rank0_view

pytestmark = pytest.mark.unit


def policy(*overrides: str) -> StepPolicy:
    return StepPolicy(load_config("tiny", ["optim.max_steps=100", "run.eval_every=50", *overrides]))


def test_the_schedule_checkpoints_and_evaluates_on_its_steps():
    steps = policy("checkpoint.every_steps=30")
    decisions = {step: steps.decide(step, None, None) for step in range(1, 101)}
    assert [s for s, d in decisions.items() if d.checkpoint] == [30, 60, 90, 100]
    assert decisions[100].checkpoint == "final" and decisions[30].checkpoint == "steps"
    assert [s for s, d in decisions.items() if d.evaluate] == [50, 100]
    assert not steps.needs_view()  # no clock, no collective


def test_a_notice_gets_a_checkpoint_at_once_and_a_last_one_before_its_deadline():
    steps = policy("checkpoint.every_steps=0")
    deadline = 1000.0
    clock = Rank0View(now=900.0, last_save=0.0, step_seconds=2.0, save_seconds=10.0)  # margin: 20 + 6 + 1 s
    assert steps.decide(7, Notice(deadline), None).checkpoint == "preemption"
    assert steps.needs_view()
    assert steps.decide(8, Notice(deadline), clock).checkpoint == ""  # the same notice again: nothing new
    assert steps.decide(9, None, Rank0View(972.0, 0.0, 2.0, 10.0)).checkpoint == ""  # 28 s left > 27 s margin
    last = steps.decide(10, None, Rank0View(973.5, 0.0, 2.0, 10.0))
    # Ray Train restarts the run at the deadline: until then, and a while after, it waits rather than train on.
    assert last.checkpoint == "deadline" and last.restart_wait_s == 26.5 + RESTART_WAIT_S
    assert steps.decide(11, None, Rank0View(990.0, 0.0, 2.0, 10.0)).checkpoint == ""  # once only
    assert not steps.needs_view()


def test_a_notice_without_deadline_gets_one_checkpoint():
    steps = policy("checkpoint.every_steps=0")
    assert steps.decide(3, Notice(None), None).checkpoint == "preemption"
    assert not steps.needs_view() and steps.decide(4, None, None).checkpoint == ""


def test_a_time_based_checkpoint_follows_rank_0s_clock_on_the_steps_that_see_it():
    steps = policy("checkpoint.every_steps=0", "checkpoint.every_minutes=1")
    assert not steps.needs_view()  # no collective every step: the pre-emption polls bring rank 0's view
    assert steps.decide(4, None, None).checkpoint == ""
    assert steps.decide(5, None, Rank0View(now=159.0, last_save=100.0, step_seconds=1, save_seconds=1)).checkpoint == ""
    assert steps.decide(6, None, Rank0View(160.0, 100.0, 1, 1)).checkpoint == "minutes"


def test_an_early_checkpoint_request_is_answered_by_the_next_checkpoint():
    steps = policy("checkpoint.every_steps=0")
    asked = Rank0View(200.0, 100.0, 1, 1, checkpoint_requested=150.0, answered_until=100.0)
    assert steps.decide(3, None, asked).checkpoint == "requested"
    # Saved at 205: the same request is answered; an older one (before the run's start) never counts.
    answered = Rank0View(210.0, 205.0, 1, 1, checkpoint_requested=150.0, answered_until=205.0)
    assert steps.decide(4, None, answered).checkpoint == ""
    assert (
        policy().decide(1, None, Rank0View(10.0, 5.0, 1, 1, checkpoint_requested=4.0, answered_until=5.0)).checkpoint
        == ""
    )


def test_a_request_made_before_a_restart_is_answered_after_it():
    """Asked at 250 (e.g. a grow, or a rebalance), the run restarted at 290 from its checkpoint of 200:
    the restart did not answer the request, a checkpoint of the resumed run does."""
    resumed = Rank0View(
        now=300.0, last_save=290.0, step_seconds=1, save_seconds=1, checkpoint_requested=250.0, answered_until=200.0
    )
    assert policy("checkpoint.every_steps=0").decide(1, None, resumed).checkpoint == "requested"


def test_a_restart_request_is_waited_for_once_after_its_checkpoint_and_never_at_the_last_step():
    """The scaling policy asks for a checkpoint to grow the run from: the run checkpoints, then waits for the
    restart."""
    steps = policy("checkpoint.every_steps=0")
    assert not steps.decide(2, None, Rank0View(200.0, 100.0, 1, 1)).restart_wait_s  # nothing asked
    asked = Rank0View(200.0, 100.0, 1, 1, checkpoint_requested=150.0, answered_until=100.0, restart_requested=150.0)
    decision = steps.decide(3, None, asked)
    assert decision.checkpoint == "requested" and decision.restart_wait_s == RESTART_WAIT_S
    # No restart came: the run trains on, and the same request is not waited for again.
    answered = Rank0View(300.0, 205.0, 1, 1, checkpoint_requested=150.0, answered_until=205.0, restart_requested=150.0)
    decision = steps.decide(4, None, answered)
    assert decision.checkpoint == "" and not decision.restart_wait_s
    # A periodic checkpoint made after the request answered it, steps ago: the run checkpoints this step all the same,
    # and waits there, so that the restart redoes none of the steps since.
    periodic = Rank0View(310.0, 305.0, 1, 1, checkpoint_requested=302.0, answered_until=305.0, restart_requested=302.0)
    decision = steps.decide(6, None, periodic)
    assert decision.checkpoint == "requested" and decision.restart_wait_s == RESTART_WAIT_S
    last = Rank0View(400.0, 305.0, 1, 1, checkpoint_requested=390.0, answered_until=305.0, restart_requested=390.0)
    decision = steps.decide(100, None, last)  # the run ends after its export, restarted or not
    assert decision.checkpoint == "requested" and not decision.restart_wait_s


def _decide_on_rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    steps = policy("checkpoint.every_steps=0", "checkpoint.every_minutes=1")
    # By rank 1's own clock its last save ended 100 s ago and a time-based checkpoint would be due;
    # by rank 0's, 10 s ago. Deciding on their own clocks, rank 1 would enter a save that rank 0 never joins.
    now = time.time()
    mine = Rank0View(now=now, last_save=now - (100.0 if rank else 10.0), step_seconds=0.1, save_seconds=0.5)
    results[rank] = steps.decide(1, None, share_rank0_view(mine, torch.device("cpu"))).checkpoint
    dist.destroy_process_group()


def test_ranks_with_different_clocks_decide_alike():
    assert on_ranks(_decide_on_rank, 2) == {0: "", 1: ""}

"""The run's elastic timeline: attempts, resizes, steps redone, goodput and cost.

A small Ray actor, started by the driver for each run, to which rank 0 of each worker group
reports: an attempt started (world size, nodes, step resumed from), each finished step,
each checkpoint, a pre-emption notice. From these it derives every resize (from -> to,
reason, seconds lost, steps redone) and the run summary. It lives outside the workers, so
it sees across restarts; workers only send it one-way messages, off the training path.

It saves its events to ``<run>/timeline.json`` (at each attempt, checkpoint and notice, and
every ``run.side_files_upload_s`` of steps), so the driver that resumes a run continues its
record: a driver that died counts as a restart ("driver lost", its last steps known as of the
last save); a run trained on after it finished (``optim.max_steps`` raised) adds a segment
whose gap is not wall time. The driver that finishes the run writes its summary,
``<run>/elastic_summary.json``.
"""

import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import ray
from pydantic import ConfigDict, Field

from train import storage
from train.run_files import try_upload
from train.schema import Section, read_record
from train.stops import RunStopped

TIMELINE_PREFIX = "raywright-timeline-"
TIMELINE = "timeline.json"  # the events of the run's drivers so far, in the run's directory
ELASTIC_SUMMARY = "elastic_summary.json"  # the run's summary, written by the driver that finished it


class StartPhases(Section):
    """Seconds that rank 0 spent on each phase of a worker group's start; None: not a phase of this start."""

    storage_wait_s: float | None = None  # for the run's storage to be reachable (an outage)
    data_s: float | None = None  # the dataset: tokenizer and splits
    convert_s: float | None = None  # a checkpoint made universal, for another world size
    engine_s: float | None = None  # the model and its DeepSpeed engine
    load_s: float | None = None  # the checkpoint resumed from


class Startup(StartPhases):
    """A worker group's start, as rank 0 reports it with its attempt."""

    entered: float  # when rank 0 entered the training function


class Resize(StartPhases):
    """A restart of the run's workers: its sizes, its cause and where its seconds went.

    The phases are known once the new workers report their start; ``seconds_lost`` at their first step.
    """

    # The file's keys are "from" and "to", as the run's metrics name them ("resize_from").
    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)

    from_workers: int = Field(alias="from")
    to_workers: int = Field(alias="to")
    reason: Literal["driver lost", "preemption", "capacity returned", "node lost", "worker failure"]
    steps_redone: int  # trained before the restart, after the checkpoint resumed from
    at_step: int  # the step resumed from
    seconds_lost: float | None = None  # from the last step before the restart to the first step after it
    driver_gone_s: float | None = None  # a driver lost: from its last step until the next driver was ready
    workers_up_s: float | None = None  # then until the new workers ran the training function


class CheckpointEvent(Section):
    """A checkpoint that counted."""

    step: int
    reason: str  # as its metadata records it (train/checkpoint.py)
    time: float


class Attempt(Section):
    """One worker group's part of the run."""

    world_size: int
    node_ids: list[str]
    node_types: dict[str, str]  # node id -> price type (e.g. "spot", "ondemand")
    resumed_step: int
    start: float
    last_step: int = -1
    last_step_end: float = 0.0
    end: float = 0.0
    preempted: bool = False
    resize: Resize | None = None  # None: the run's first attempt, or a segment added after it finished


class TimelineState(Section):
    """What ``timeline.json`` holds: the events of the run's drivers so far."""

    attempts: list[Attempt] = []
    step_seconds: dict[int, float] = {}  # the execution of each step that counted
    checkpoints: list[CheckpointEvent] = []
    finished: float = 0.0  # when the last driver's part of the run ended; 0: it was lost, or it runs


class WorldSizeSegment(Section):
    world_size: int
    from_step: int  # the step its attempt resumed from
    start_s: float  # from the run's start


class ElasticSummary(Section):
    """A run's world-size timeline, restarts, steps redone, goodput and cost: ``elastic_summary.json``."""

    world_size_timeline: list[WorldSizeSegment]
    resizes: list[Resize]
    restarts: int
    steps_redone: int
    wall_s: float  # the run's wall time, less the gaps before segments added after it finished
    step_s: float  # the execution of the steps that counted
    goodput: float  # step_s / wall_s
    checkpoints: list[CheckpointEvent]
    node_hours: dict[str, float]  # by price type
    cost: float | None = None  # None: no prices set (cost.price_per_hour)
    cost_on_demand_only: float | None = None  # the same node hours, all at the on-demand price


@dataclass(frozen=True)
class Progress:
    """A running run's attempts so far, world size and last step (for tests, benchmarks, dashboards)."""

    attempts: int = 0
    world_size: int | None = None  # None: no attempt started yet
    step: int = -1  # -1: none finished yet


# Where a restart's seconds go, in order; the first step after them completes the seconds lost.
RESTART_PHASES = ("driver_gone_s", "workers_up_s", "storage_wait_s", "data_s", "convert_s", "engine_s", "load_s")


def timeline_of(run_name: str):
    """The RunTimeline actor of a running run, or None."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    name = next((n for n in names if n.startswith(f"{TIMELINE_PREFIX}{run_name}-")), None)
    return ray.get_actor(name) if name else None


def progress_of(run_name: str) -> Progress:
    """Attempts, world size and last step of a running run."""
    timeline = timeline_of(run_name)
    return ray.get(timeline.progress.remote()) if timeline else Progress()


def describe_resize(resize: Resize) -> str:
    """``resize 3 -> 2 workers (node lost): 14.2 s lost (workers up 6.0 s, ...), 2 steps redone``."""
    seconds = {key: getattr(resize, key) for key in RESTART_PHASES}
    phases = ", ".join(f"{key[:-2].replace('_', ' ')} {s:.1f} s" for key, s in seconds.items() if s is not None)
    return (
        f"resize {resize.from_workers} -> {resize.to_workers} workers ({resize.reason}): "
        f"{resize.seconds_lost or 0.0:.1f} s lost ({phases}), {resize.steps_redone} steps redone"
    )


def node_price_type(resources: dict[str, float], prices: dict[str, float], default: str) -> str:
    """The first price type that the node offers as a resource (e.g. ``spot``), else ``default``."""
    return next((kind for kind in prices if resources.get(kind, 0) > 0), default)


def read_saved_state(run_uri: str) -> TimelineState | None:
    """The events that the run's drivers saved; None where there are none. ConfigError naming the file and the
    field where they are not a record this version reads."""
    return read_record(TimelineState, storage.join(run_uri, TIMELINE), "a run timeline")


def read_summary(run_uri: str) -> ElasticSummary | None:
    """The run's summary; None where no driver wrote one. ConfigError as ``read_saved_state``."""
    return read_record(ElasticSummary, storage.join(run_uri, ELASTIC_SUMMARY), "an elastic summary")


def write_summary(run_uri: str, summary: ElasticSummary) -> None:
    storage.write_json(storage.join(run_uri, ELASTIC_SUMMARY), summary.model_dump(exclude_none=True))


class Timeline:
    """The run's event log and its derived figures; run as the ``RunTimeline`` actor.

    ``run_uri``: where to save the events (None: kept in memory only); ``saved``: what an earlier driver of the run
    saved there, continued."""

    def __init__(
        self,
        prices: dict[str, float],
        on_demand_type: str,
        run_uri: str | None = None,
        saved: TimelineState | None = None,
        save_every_s: float = 30.0,
    ):
        self.prices = prices
        self.on_demand_type = on_demand_type
        self.uri = run_uri and storage.join(run_uri, TIMELINE)
        self.save_every_s = save_every_s
        self.saved_at = 0.0
        self.state = saved or TimelineState()
        # The driver that saved it died: its last attempt ended with its last step known.
        self.driver_lost = bool(self.state.attempts) and not self.state.finished
        self.created = time.time()  # when this driver had the run's dataset ready
        self._stop: RunStopped | None = None

    def _save(self) -> None:
        """Write the events to the run's storage; a failed write is logged and left to the next save."""
        if self.uri:
            data = self.state.model_dump_json(exclude_none=True).encode()
            try_upload(lambda: storage.write_bytes(self.uri, data), self.uri, "the run's timeline")
            self.saved_at = time.time()

    def attempt_started(
        self,
        world_size: int,
        node_ids: list[str],
        resumed_step: int,
        startup: Startup | None = None,
        resumed_checkpoint: CheckpointEvent | None = None,
    ) -> None:
        """``startup``: when rank 0 entered the training function and the seconds it then spent on each phase of
        the start. ``resumed_checkpoint``: the checkpoint resumed from."""
        now = time.time()
        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
        types = {n: node_price_type(resources.get(n, {}), self.prices, self.on_demand_type) for n in set(node_ids)}
        attempt = Attempt(
            world_size=world_size, node_ids=node_ids, node_types=types, resumed_step=resumed_step, start=now
        )
        # Steps after the restored checkpoint are redone; they no longer count.
        for step in [s for s in self.state.step_seconds if s > resumed_step]:
            del self.state.step_seconds[step]
        if self.state.finished:  # a run trained on after it finished: a new segment, not a restart
            self.state.finished = 0.0
        elif self.state.attempts:
            previous = self.state.attempts[-1]
            previous.end = previous.end or ((previous.last_step_end or previous.start) if self.driver_lost else now)
            # A checkpoint is recorded after it counts: a restart in between (the grow it answered, a node lost)
            # can stop its attempt before the record is sent.
            saved = {checkpoint.step for checkpoint in self.state.checkpoints}
            if resumed_checkpoint and resumed_checkpoint.step not in saved:
                self.state.checkpoints.append(resumed_checkpoint)
            attempt.resize = Resize(
                from_workers=previous.world_size,
                to_workers=world_size,
                reason="driver lost" if self.driver_lost else self._reason(previous, world_size),
                steps_redone=max(0, previous.last_step - resumed_step),
                at_step=resumed_step,
                **(self._restart_phases(previous, startup) if startup else {}),
            )
        self.driver_lost = False
        self.state.attempts.append(attempt)
        self._save()

    def _restart_phases(self, previous: Attempt, startup: Startup) -> dict[str, float]:
        """Where a restart's seconds went: from the last step before it until the new workers ran the training
        function (after a driver lost, first until the next driver was ready to start them), then ``startup``'s."""
        last_step_end = previous.last_step_end or previous.start
        phases = startup.model_dump(exclude={"entered"}, exclude_none=True)
        if self.driver_lost:
            phases["driver_gone_s"] = self.created - last_step_end
        phases["workers_up_s"] = startup.entered - (self.created if self.driver_lost else last_step_end)
        return phases

    @staticmethod
    def _reason(previous: Attempt, world_size: int) -> str:
        if previous.preempted:
            return "preemption"
        if world_size > previous.world_size:
            return "capacity returned"
        if world_size < previous.world_size:
            return "node lost"
        return "worker failure"

    def step_done(self, step: int, seconds: float, end: float) -> None:
        attempt = self.state.attempts[-1]
        if attempt.last_step < 0 and attempt.resize is not None:
            # Seconds lost: from the last step of the previous attempt to the first of this one.
            previous = self.state.attempts[-2]
            attempt.resize.seconds_lost = end - seconds - (previous.last_step_end or previous.start)
        attempt.last_step, attempt.last_step_end = step, end
        self.state.step_seconds[step] = seconds
        if time.time() - self.saved_at >= self.save_every_s:
            self._save()

    def checkpoint_saved(self, step: int, reason: str) -> None:
        self.state.checkpoints.append(CheckpointEvent(step=step, reason=reason, time=time.time()))
        self._save()

    def preemption_notice(self) -> None:
        self.state.attempts[-1].preempted = True
        self._save()

    def finished(self) -> None:
        """This driver's part of the run ended (trained to the end, stopped or failed), not lost with its driver."""
        self.state.finished = time.time()
        if self.state.attempts:
            self.state.attempts[-1].end = self.state.finished
        self._save()

    def record_stop(self, stopped: RunStopped) -> None:
        """The workers ended the run early: kept here for the driver, where a full disk cannot lose it as it can
        the stop's report line in metrics.jsonl."""
        self._stop = stopped

    def stop(self) -> RunStopped | None:
        return self._stop

    def progress(self) -> Progress:
        if not self.state.attempts:
            return Progress()
        attempt = self.state.attempts[-1]
        return Progress(attempts=len(self.state.attempts), world_size=attempt.world_size, step=attempt.last_step)

    def latest_resize(self) -> Resize | None:
        return self.state.attempts[-1].resize if self.state.attempts else None

    def summary(self) -> ElasticSummary | None:
        return summarize(self.state, self.prices, self.on_demand_type)


RunTimeline = ray.remote(num_cpus=0)(Timeline)


def summarize(state: TimelineState, prices: dict[str, float], on_demand_type: str) -> ElasticSummary | None:
    """World-size timeline, restarts, steps redone, goodput and cost of a run; None before its first attempt."""
    attempts = state.attempts
    if not attempts:
        return None
    end = state.finished or attempts[-1].last_step_end or time.time()
    # Less the gaps before the segments added to a finished run (an attempt without a resize, after the first).
    gaps = sum(later.start - earlier.end for earlier, later in pairwise(attempts) if later.resize is None)
    wall = end - attempts[0].start - gaps
    node_seconds: dict[str, float] = {}
    for attempt in attempts:
        seconds = (attempt.end or end) - attempt.start
        for kind in attempt.node_types.values():
            node_seconds[kind] = node_seconds.get(kind, 0.0) + seconds
    useful = sum(state.step_seconds.values(), 0.0)
    resizes = [a.resize for a in attempts if a.resize]
    costs: dict[str, float] = {}
    if prices:
        costs["cost"] = sum(prices.get(kind, 0.0) * s / 3600 for kind, s in node_seconds.items())
        costs["cost_on_demand_only"] = prices.get(on_demand_type, 0.0) * sum(node_seconds.values()) / 3600
    return ElasticSummary(
        world_size_timeline=[
            WorldSizeSegment(world_size=a.world_size, from_step=a.resumed_step, start_s=a.start - attempts[0].start)
            for a in attempts
        ],
        resizes=resizes,
        restarts=len(resizes),
        steps_redone=sum(resize.steps_redone for resize in resizes),
        wall_s=wall,
        step_s=useful,
        goodput=useful / wall if wall > 0 else 0.0,
        checkpoints=state.checkpoints,
        node_hours={kind: s / 3600 for kind, s in node_seconds.items()},
        **costs,
    )

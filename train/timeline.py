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
whose gap is not wall time.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import ray

from train import storage
from train.run_files import try_upload


@dataclass
class Attempt:
    world_size: int
    node_ids: list[str]
    node_types: dict[str, str]  # node id -> price type (e.g. "spot", "ondemand")
    resumed_step: int
    start: float
    last_step: int = -1
    last_step_end: float = 0.0
    end: float = 0.0
    preempted: bool = False
    resize: dict[str, Any] | None = None


@dataclass
class TimelineState:
    attempts: list[Attempt] = field(default_factory=list)
    step_seconds: dict[int, float] = field(default_factory=dict)  # the execution of each step that counted
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    finished: float = 0.0


TIMELINE_PREFIX = "raywright-timeline-"
TIMELINE = "timeline.json"  # the events of the run's drivers so far, in the run's directory
# Where a restart's seconds go, in order; the first step after them completes the seconds lost.
RESTART_PHASES = ("driver_gone_s", "workers_up_s", "storage_wait_s", "data_s", "convert_s", "engine_s", "load_s")


def timeline_of(run_name: str):
    """The RunTimeline actor of a running run, or None."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    name = next((n for n in names if n.startswith(f"{TIMELINE_PREFIX}{run_name}-")), None)
    return ray.get_actor(name) if name else None


def progress_of(run_name: str) -> dict[str, Any]:
    """Attempts, world size and last step of a running run (for tests, benchmarks, dashboards)."""
    timeline = timeline_of(run_name)
    if timeline is None:
        return {"attempts": 0, "world_size": None, "step": -1}
    return ray.get(timeline.progress.remote())


def describe_resize(resize: dict[str, Any]) -> str:
    """``resize 3 -> 2 workers (node lost): 14.2 s lost (workers up 6.0 s, ...), 2 steps redone``."""
    phases = ", ".join(f"{key[:-2].replace('_', ' ')} {resize[key]:.1f} s" for key in RESTART_PHASES if key in resize)
    return (
        f"resize {resize['from']} -> {resize['to']} workers ({resize['reason']}): "
        f"{resize.get('seconds_lost', 0.0):.1f} s lost ({phases}), {resize['steps_redone']} steps redone"
    )


def node_price_type(resources: dict[str, float], prices: dict[str, float], default: str) -> str:
    """The first price type that the node offers as a resource (e.g. ``spot``), else ``default``."""
    return next((kind for kind in prices if resources.get(kind, 0) > 0), default)


def state_from_json(saved: dict[str, Any]) -> TimelineState:
    """A ``TimelineState`` as ``Timeline`` saved it (JSON keys are strings: the steps are made ints again)."""
    return TimelineState(
        attempts=[Attempt(**attempt) for attempt in saved["attempts"]],
        step_seconds={int(step): seconds for step, seconds in saved["step_seconds"].items()},
        checkpoints=saved["checkpoints"],
        finished=saved["finished"],
    )


class Timeline:
    """The run's event log and its derived figures; run as the ``RunTimeline`` actor.

    ``run_uri``: where to save the events (None: kept in memory only); ``saved``: what an earlier driver of the run
    saved there, continued."""

    def __init__(
        self,
        prices: dict[str, float],
        on_demand_type: str,
        run_uri: str | None = None,
        saved: dict[str, Any] | None = None,
        save_every_s: float = 30.0,
    ):
        self.prices = prices
        self.on_demand_type = on_demand_type
        self.uri = run_uri and storage.join(run_uri, TIMELINE)
        self.save_every_s = save_every_s
        self.saved_at = 0.0
        self.state = state_from_json(saved) if saved else TimelineState()
        # The driver that saved it died: its last attempt ended with its last step known.
        self.driver_lost = bool(self.state.attempts) and not self.state.finished
        self.created = time.time()  # when this driver had the run's dataset ready

    def _save(self) -> None:
        """Write the events to the run's storage; a failed write is logged and left to the next save."""
        if self.uri:
            data = json.dumps(asdict(self.state)).encode()
            try_upload(lambda: storage.write_bytes(self.uri, data), self.uri, "the run's timeline")
            self.saved_at = time.time()

    def attempt_started(
        self,
        world_size: int,
        node_ids: list[str],
        resumed_step: int,
        startup: dict[str, float] | None = None,
        resumed_checkpoint: dict[str, Any] | None = None,
    ) -> None:
        """``startup``: when rank 0 entered the training function (``entered``) and the seconds it then
        spent on each phase of the start (``RESTART_PHASES``). ``resumed_checkpoint``: the step, reason and time
        of the checkpoint resumed from."""
        now = time.time()
        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
        types = {n: node_price_type(resources.get(n, {}), self.prices, self.on_demand_type) for n in set(node_ids)}
        attempt = Attempt(world_size, node_ids, types, resumed_step, start=now)
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
            saved = {checkpoint["step"] for checkpoint in self.state.checkpoints}
            if resumed_checkpoint and resumed_checkpoint["step"] not in saved:
                self.state.checkpoints.append(resumed_checkpoint)
            attempt.resize = {
                "from": previous.world_size,
                "to": world_size,
                "reason": "driver lost" if self.driver_lost else self._reason(previous, world_size),
                "steps_redone": max(0, previous.last_step - resumed_step),
                "at_step": resumed_step,
            }
            if startup:
                # From the last step before the restart until the new workers ran the training function; after a
                # driver lost, first until the next driver was ready to start them.
                last_step_end = previous.last_step_end or previous.start
                gone = {"driver_gone_s": self.created - last_step_end} if self.driver_lost else {}
                workers_from = self.created if self.driver_lost else last_step_end
                startup = {**startup, **gone, "workers_up_s": startup["entered"] - workers_from}
                attempt.resize.update({key: startup[key] for key in RESTART_PHASES if key in startup})
        self.driver_lost = False
        self.state.attempts.append(attempt)
        self._save()

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
            attempt.resize["seconds_lost"] = end - seconds - (previous.last_step_end or previous.start)
        attempt.last_step, attempt.last_step_end = step, end
        self.state.step_seconds[step] = seconds
        if time.time() - self.saved_at >= self.save_every_s:
            self._save()

    def checkpoint_saved(self, step: int, reason: str) -> None:
        self.state.checkpoints.append({"step": step, "reason": reason, "time": time.time()})
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

    def progress(self) -> dict[str, Any]:
        """The current world size and last step (for tests and dashboards)."""
        attempt = self.state.attempts[-1] if self.state.attempts else None
        return {
            "attempts": len(self.state.attempts),
            "world_size": attempt and attempt.world_size,
            "step": attempt.last_step if attempt else -1,
        }

    def latest_resize(self) -> dict[str, Any] | None:
        return self.state.attempts[-1].resize if self.state.attempts else None

    def summary(self) -> dict[str, Any]:
        return summarize(self.state, self.prices, self.on_demand_type)


RunTimeline = ray.remote(num_cpus=0)(Timeline)


def summarize(state: TimelineState, prices: dict[str, float], on_demand_type: str) -> dict[str, Any]:
    """World-size timeline, restarts, steps redone, goodput and cost of a run."""
    attempts = state.attempts
    if not attempts:
        return {}
    end = state.finished or attempts[-1].last_step_end or time.time()
    # Less the gaps before the segments added to a finished run (an attempt without a resize, after the first).
    gaps = sum(later.start - earlier.end for earlier, later in pairwise(attempts) if later.resize is None)
    wall = end - attempts[0].start - gaps
    node_seconds: dict[str, float] = {}
    for attempt in attempts:
        seconds = (attempt.end or end) - attempt.start
        for kind in attempt.node_types.values():
            node_seconds[kind] = node_seconds.get(kind, 0.0) + seconds
    useful = sum(state.step_seconds.values())
    resizes = [a.resize for a in attempts if a.resize]
    summary = {
        "world_size_timeline": [
            {"world_size": a.world_size, "from_step": a.resumed_step, "start_s": a.start - attempts[0].start}
            for a in attempts
        ],
        "resizes": resizes,
        "restarts": len(resizes),
        "steps_redone": sum(resize["steps_redone"] for resize in resizes),
        "wall_s": wall,
        "step_s": useful,
        "goodput": useful / wall if wall > 0 else 0.0,
        "checkpoints": state.checkpoints,
        "node_hours": {kind: s / 3600 for kind, s in node_seconds.items()},
    }
    if prices:
        summary["cost"] = sum(prices.get(kind, 0.0) * s / 3600 for kind, s in node_seconds.items())
        summary["cost_on_demand_only"] = prices.get(on_demand_type, 0.0) * sum(node_seconds.values()) / 3600
    return summary

"""torch.profiler over a range of optimizer steps (``run.profile_steps``): where a step's time goes.

Every rank writes a Chrome trace (chrome://tracing, Perfetto) to ``<run>/profile/``; rank 0 also prints
the ops that took the most time and how busy the device was over the profiled steps' wall time, which
tells a launch-bound step (a GPU idle between small kernels) from a compute-bound one.
"""

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from train import storage

TOP_OPS = 15


class StepProfiler:
    """Profiles optimizer steps ``first..last`` (the run's step numbers, counted from 1) on this rank."""

    def __init__(self, steps: list[int], run_uri: str, rank: int, device: torch.device):
        self.first, self.last = steps or (0, -1)  # step 0 never runs: nothing is profiled
        self.run_uri, self.rank, self.device = run_uri, rank, device
        self._profile: profile | None = None
        self._started = 0.0

    @contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Wraps the work of optimizer step ``number``."""
        if number == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profile = profile(activities=activities)
            self._sync()
            self._profile.start()
            self._started = time.perf_counter()
        yield
        if number == self.last and self._profile is not None:
            self._sync()  # the steps' kernels are done, so they are in the trace and in the wall time
            wall_s = time.perf_counter() - self._started
            self._profile.stop()
            self._write(self._profile, wall_s)
            self._profile = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, done: profile, wall_s: float) -> None:
        name = f"steps{self.first}-{self.last}-rank{self.rank}.json"
        uri = storage.join(self.run_uri, "profile", name)
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, name)
            done.export_chrome_trace(local)
            with open(local, "rb") as f:
                storage.write_bytes(uri, f.read())
        if self.rank == 0:
            print(self.summary(done, wall_s) + f"\ntrace of every rank in {storage.join(self.run_uri, 'profile')}/")

    def summary(self, done: profile, wall_s: float) -> str:
        """The profiled steps' wall time, the device's busy share of it, and the top ops by self time."""
        events = done.key_averages()
        steps = self.last - self.first + 1
        head = f"profile of steps {self.first}-{self.last}: {1000 * wall_s / steps:.1f} ms per step"
        if self.device.type == "cuda":
            # Kernels and copies, as the table's own total counts them; streams that overlap can add to over 100%.
            on_device = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
            busy_s = sum(event.self_device_time_total for event in on_device) / 1e6
            head += f", device busy {100 * busy_s / wall_s:.0f}% of it"
            sort_by = "self_device_time_total"
        else:
            sort_by = "self_cpu_time_total"
        return head + "\n" + events.table(sort_by=sort_by, row_limit=TOP_OPS)

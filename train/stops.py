"""Ends of a training run that restarting it would only repeat.

Ray Train restarts a run whose worker raised, ``scaling.max_failures`` times, from its newest checkpoint. Where the
cause stays (weights that diverge again, a disk that is still full), each restart redoes the steps since that
checkpoint to fail alike. So every rank reports such an end at the same step, under its kind's ``key``, and
returns; the driver raises it again from that report, the run's last.
"""

from typing import Any, ClassVar

from train.schema import ConfigError


class RunStopped(RuntimeError):
    """An end of the run at ``step``, on every rank alike, that a restart would repeat."""

    key: ClassVar[str]

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):  # pickled whole between Ray's processes: the default would call __init__ without step
        return type(self), (str(self), self.step)

    def report(self, time: float) -> dict[str, Any]:
        """The run's last report, which names it."""
        return {"step": self.step, self.key: str(self), "time": time}


class DivergedError(RunStopped):
    """The training loss or the weights stopped being finite."""

    key = "diverged"


class OutOfDiskError(RunStopped):
    """A checkpoint or the export could not be written for want of space on a disk."""

    key = "out_of_disk"


class StorageNotSharedError(RunStopped, ConfigError):
    """A worker does not see the run's local folder: it runs on another machine that does not mount it. A config
    error, said as the driver's own check says it."""

    key = "storage_not_shared"


def stop_in(report: dict[str, Any]) -> RunStopped | None:
    """The end that ``report`` names, if it is one."""
    for kind in (DivergedError, OutOfDiskError, StorageNotSharedError):
        if kind.key in report:
            return kind(report[kind.key], report["step"])
    return None

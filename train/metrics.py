"""Metrics: measured on the workers, recorded on the Ray Train controller.

Workers report through ``ray.train.report``; this callback runs in the controller and
appends every report to ``<run>/metrics.jsonl`` and, when the ``tensorboard`` extra is
installed, to TensorBoard event files in ``<run>/tensorboard``, wherever the run lives.
"""

import contextlib
import functools
import logging
import math
import resource
import time
from typing import Any

import torch
from ray.train.v2.api.callback import UserCallback

from train import storage
from train.run_files import JsonlLog, drop_node_local_copy, local_dir_for, read_jsonl, try_upload, upload_dir
from train.stops import stop_in

METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
# Ray Train's controller poll, which takes the workers' reports: set by the driver, read by the workers' warning.
HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"

logger = logging.getLogger(__name__)

# Dense bf16 peak TFLOP/s per device, by a substring of torch.cuda.get_device_name().
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def peak_tflops(configured: float) -> float | None:
    """Peak TFLOP/s of this worker's device for MFU: the configured value, a known GPU's, or None."""
    if configured:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((peak for gpu, peak in GPU_PEAK_TFLOPS.items() if gpu in name), None)
    return None


def memory_gb() -> float:
    """Peak memory of this worker: GPU memory allocated, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB


def format_progress(m: dict[str, Any], max_steps: int) -> str:
    parts = [f"step {m['step']}/{max_steps}"]
    if "loss" in m:
        parts += [f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"{m['tokens_per_s']:,.0f} tok/s"]
        parts += [f"mfu {m['mfu']:.1%}" if m.get("mfu") is not None else "mfu n/a", f"mem {m['memory_gb']:.2f} GB"]
    if "loss_scale" in m:
        parts.append(f"loss scale {m['loss_scale']:g}, {m['skipped_steps']} steps skipped")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_perplexity']:.2f}, {m['val_bpb']:.3f} bits/byte)")
    # A checkpoint written in the background counts at a later step's report, often one of its own.
    if "checkpoint" in m:
        parts.append(f"checkpoint {m['checkpoint'].rsplit('/', 1)[-1]} saved ({m['checkpoint_s']:.1f} s)")
    if "checkpoint_failed" in m:
        parts.append(f"checkpoint {m['checkpoint_failed'].rsplit('/', 1)[-1]} failed")
    return " | ".join(parts)


def report_backlog_warning(step_seconds: float, log_every: int, poll_seconds: float) -> str | None:
    """A warning where the run reports more often than Ray Train's controller takes reports (at each poll of the
    workers, one report per worker): each report then waits for the one before it, and training with it (tiny
    model on 2 CPU workers, 0.5 s polls: 99 steps of 0.15 s took 51 s with a report each, 17 s with one every 10).
    """
    if step_seconds * log_every >= poll_seconds:
        return None
    return (
        f"warning: a report every {step_seconds * log_every:.2f} s (run.log_every={log_every}) comes faster than "
        f"Ray Train takes them (every {poll_seconds:g} s, scaling.health_check_interval_s): training waits for "
        f"each; run.log_every={math.ceil(poll_seconds / step_seconds)} or more does not"
    )


class MetricsRecorder(UserCallback):
    """Appends rank 0's reported metrics to ``<run>/metrics.jsonl`` and TensorBoard in ``<run>/tensorboard``.

    On object storage both are uploaded every ``upload_every_s``, with every checkpoint (so a driver
    killed outright loses at most reports that its resume redoes: none where it resumes on the same node,
    which merges them in), at the last step and after a failure;
    their node-local copies are deleted after the last step's upload. An upload that fails is logged and
    retried at the next: an exception here would end the run (Ray Train does not retry a callback's).
    """

    def __init__(self, run_uri: str, max_steps: int, upload_every_s: float):
        self.run_uri = run_uri
        self.max_steps = max_steps
        self.upload_every_s = upload_every_s
        self._log: JsonlLog | None = None  # opened where the callback runs (Ray Train's controller)
        self._writer = None
        self._tensorboard_dir = ""
        self._uploaded = 0.0

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        record = metrics[0]
        if self._log is None:
            self._log = JsonlLog(storage.join(self.run_uri, METRICS))
            self._uploaded = time.monotonic()
        self._log.append(record)
        self._add_to_tensorboard(record)
        due = time.monotonic() - self._uploaded >= self.upload_every_s
        if record["step"] >= self.max_steps or stop_in(record):  # the run's last report
            self._close()
        elif due or "checkpoint" in record:
            self._upload()

    def after_exception(self, run_context, worker_exceptions) -> None:
        if self._log is not None:
            self._upload()

    def _upload(self) -> bool:
        """Upload both; returns whether both are uploaded (a failure is logged)."""
        uploaded = self._log.flush()
        if self._tensorboard_dir:
            tensorboard = storage.join(self.run_uri, TENSORBOARD)
            upload = functools.partial(upload_dir, self._tensorboard_dir, tensorboard)
            uploaded = try_upload(upload, tensorboard, self._tensorboard_dir) and uploaded
        self._uploaded = time.monotonic()
        return uploaded

    def _close(self) -> None:
        """Upload, and delete this node's copies at the run's end (a later report would open them again);
        where the upload failed, the copies stay (logged)."""
        self._close_tensorboard()  # before the upload, which takes its last events
        if self._upload():
            for side_file in (METRICS, TENSORBOARD):
                drop_node_local_copy(storage.join(self.run_uri, side_file))
        else:
            logger.warning("not all side files of %s were uploaded: this node keeps them", self.run_uri)
        self._log, self._tensorboard_dir = None, ""

    def _add_to_tensorboard(self, record: dict[str, Any]) -> None:
        """The record's numbers as TensorBoard scalars. Events that cannot be written (a full disk) are logged and
        dropped, the writer with them: a new one starts an events file at the next report. Nothing else is lost:
        metrics.jsonl keeps every report."""
        try:
            writer = self._tensorboard()
            if writer is None:
                return
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    writer.add_scalar(key, value, record["step"])
            writer.flush()
        except OSError as exc:
            logger.warning("TensorBoard events of %s could not be written, and are dropped: %s", self.run_uri, exc)
            self._close_tensorboard()

    def _tensorboard(self):
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the tensorboard extra is optional
                return None
            self._tensorboard_dir = local_dir_for(storage.join(self.run_uri, TENSORBOARD))
            self._writer = SummaryWriter(self._tensorboard_dir)
        return self._writer

    def _close_tensorboard(self) -> None:
        """Close the writer, which writes its last events (one whose writes failed raises that failure again)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(OSError):
                writer.close()


def read_metrics(run_uri: str) -> list[dict[str, Any]]:
    return read_jsonl(storage.join(run_uri, METRICS))


def steady_step_seconds(run_uri: str) -> float:
    """Seconds per optimizer step of a finished run, from its training reports' wall-clock stamps, leaving out
    the first report's window (start-up, compilation) and the last's (the final evaluation and save)."""
    reports = [m for m in read_metrics(run_uri) if "loss" in m][1:-1]
    if len(reports) < 2:
        raise ValueError(
            f"{run_uri}: too few training reports for a steady step time; a run needs optim.max_steps of at "
            "least 3 x run.log_every"
        )
    return (reports[-1]["time"] - reports[0]["time"]) / (reports[-1]["step"] - reports[0]["step"])

"""Metrics: measured on the workers, recorded on the Ray Train controller.

Workers report through ``ray.train.report``; this callback runs in the controller and
appends every report to ``<run>/metrics.jsonl`` and, when the ``tensorboard`` extra is
installed, to TensorBoard event files in ``<run>/tensorboard``.
"""

import json
import os
import resource
from typing import Any

import torch
from ray.train.v2.api.callback import UserCallback

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
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_perplexity']:.2f}, {m['val_bpb']:.3f} bits/byte)")
    return " | ".join(parts)


class MetricsRecorder(UserCallback):
    """Appends rank 0's reported metrics to metrics.jsonl and TensorBoard in ``run_dir``."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._writer = None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        record = metrics[0]
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        writer = self._tensorboard()
        if writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    writer.add_scalar(key, value, record["step"])
            writer.flush()

    def _tensorboard(self):
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the tensorboard extra is optional
                return None
            self._writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
        return self._writer


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]

"""Typed configuration of a served model; the same fields from YAML, ``--set`` overrides and Serve's app args."""

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from train.schema import Section, parse, read_tree

# The served weights' and compute's precision (serve/precision.py); named here, where no torch is needed.
Precision = Literal["fp32", "bf16", "int8", "fp8"]


class ServeConfig(Section):
    checkpoint: str = ""
    """A training export, its run directory, or any Hugging Face GPT-2 directory; local or URI (required)."""
    model_name: str = ""
    """The name clients pass as "model"; "" = the training run's name."""
    precision: Literal["auto", Precision] = "auto"
    """Weights and compute: fp32, bf16, int8, or fp8 (GPU only); auto = bf16 on a GPU, int8 on a CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where replicas run the model; auto = a GPU if the replica has one."""
    cuda_graphs: bool = True
    """On a GPU, replay each decode shape and each small prefill shape as a captured CUDA graph; false runs
    them eagerly."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the decode step when the replica starts (seconds); auto = on a GPU (1.31-1.35x the
    tokens/s on an H200). On a CPU it gains nothing: 0.99x at batch 1, 0.93-1.19x at 64 (BENCHMARKS.md, P7)."""
    batching: Literal["continuous", "serve_batch", "none"] = "continuous"
    """Continuous batching; serve_batch (Ray Serve's @serve.batch) and none are for comparison."""
    max_batch_size: int = Field(32, ge=1)
    """Sequences decoded together per replica."""
    batch_wait_timeout_s: float = Field(0.01, ge=0.0)
    """serve_batch only: how long a batch waits to fill."""
    max_ongoing_requests: int = Field(64, ge=1)
    """Requests per replica; at least max_batch_size so that batches can fill."""
    max_queued_requests: int = Field(256, ge=1)
    """Requests queued per caller; beyond it requests get 429 with Retry-After."""
    retry_after_s: int = Field(1, ge=0)
    """The Retry-After of a 429."""
    min_replicas: int = Field(1, ge=1)
    """Replicas kept up."""
    max_replicas: int = Field(1, ge=1)
    """Replicas the autoscaler may add."""
    target_ongoing_requests: float = Field(32.0, gt=0.0)
    """The autoscaler aims at this many requests per replica."""
    cpus_per_replica: float = Field(1.0, gt=0.0)
    """CPUs each replica reserves."""
    torch_threads: int = Field(1, ge=1)
    """Torch threads per replica (one thread per replica was 5-15x faster than two under load on CPU)."""
    api_key_file: str = ""
    """A file on the replica's node whose first line is the API key clients must send; "" = the replica's
    RAYWRIGHT_API_KEY, else no key. The key itself is never a config value: Serve stores configs where
    others can read them."""
    request_timeout_s: float = Field(300.0, gt=0.0)
    """A request still generating then ends with 504 (or an error event when streaming). A replica that Serve
    stops lets its requests in flight run this long (plus a few seconds) before it is killed."""
    max_request_bytes: int = Field(1_000_000, ge=1)
    """Larger bodies get 413 before anything reads them."""

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        if not self.checkpoint:
            raise ValueError("checkpoint: give the training export to serve (a path or URI)")
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be >= max_batch_size "
                f"({self.max_batch_size}): a replica never sees more requests than that, so batches could not fill"
            )
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        return self

    def resolved_device(self, cuda_available: bool) -> Literal["cuda", "cpu"]:
        """``device`` with auto resolved: a GPU where the replica's machine has one."""
        return "cuda" if self.device == "cuda" or (self.device == "auto" and cuda_available) else "cpu"

    def resolved_precision(self, device: str) -> Precision:
        """``precision`` with auto resolved for ``device``.

        On a GPU bf16: torchao's int8 and fp8 weight-only modes were slower than bf16 on an H100 (see
        BENCHMARKS.md, P7), and fp8 rowwise is not measured yet. On a CPU int8: as accurate as fp32, and 1.3x its
        throughput where the CPU has VNNI (P6c).
        """
        if self.precision != "auto":
            return self.precision
        return "bf16" if device == "cuda" else "int8"

    def resolved_api_key(self) -> str:
        """The key the replica requires ("" for none); a key file that is missing or empty is an error."""
        if self.api_key_file:
            try:
                with open(os.path.expanduser(self.api_key_file)) as f:
                    key = f.readline().strip()
            except OSError as exc:
                raise ValueError(f"api_key_file: cannot read {self.api_key_file}: {exc.strerror}") from None
            if not key:
                raise ValueError(f"api_key_file: {self.api_key_file} is empty")
            return key
        return os.environ.get("RAYWRIGHT_API_KEY", "").strip()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def serve_config_from_dict(values: dict[str, Any]) -> ServeConfig:
    return parse(ServeConfig, values)


def load_serve_config(path: str | None = None, overrides: list[str] = ()) -> ServeConfig:
    """A ServeConfig from an optional YAML file plus ``key=value`` overrides."""
    return serve_config_from_dict(read_tree(path, overrides, "serve config"))

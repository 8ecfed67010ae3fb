"""Typed configuration of a served model; the same fields from YAML, ``--set`` overrides and Serve's app args."""

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

from serve.precision import PRECISIONS
from train.config import build_config, read_tree


@dataclass
class ServeConfig:
    checkpoint: str = ""  # a training export, its run dir, or any Hugging Face GPT-2 directory; local or URI
    model_name: str = ""  # the name clients pass as "model"; "" = the training run's name
    precision: str = "auto"  # fp32, bf16, int8 or fp8 (GPU only); auto = int8
    device: Literal["auto", "cpu", "cuda"] = "auto"
    batching: Literal["continuous", "serve_batch", "none"] = "continuous"  # serve_batch/none: for comparison
    max_batch_size: int = 32  # sequences decoded together per replica
    batch_wait_timeout_s: float = 0.01  # serve_batch only
    max_ongoing_requests: int = 64  # per replica; at least max_batch_size so batches can fill
    max_queued_requests: int = 256  # per caller; beyond it requests get 429 with Retry-After
    retry_after_s: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 32.0  # autoscaling aims at this many requests per replica
    cpus_per_replica: float = 1.0
    torch_threads: int = 1  # one thread per replica was 5-15x faster than two under load on CPU
    # The API key is never a config value (Serve stores configs where others can read them): it is the
    # first line of this file on the replica's node, else the replica's RAYWRIGHT_API_KEY, else none.
    api_key_file: str = ""
    request_timeout_s: float = 300.0  # a request still generating then ends with 504 (or an error event)
    max_request_bytes: int = 1_000_000  # larger bodies get 413 before anything reads them

    def validate(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint: give the training export to serve (a path or URI)")
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(f"precision: {self.precision!r} is not one of {['auto', *PRECISIONS]}")
        for key in (
            "max_batch_size",
            "max_ongoing_requests",
            "max_queued_requests",
            "min_replicas",
            "torch_threads",
            "max_request_bytes",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be >= max_batch_size "
                f"({self.max_batch_size}): a replica never sees more requests than that, so batches could not fill"
            )
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.target_ongoing_requests <= 0 or self.batch_wait_timeout_s < 0 or self.retry_after_s < 0:
            raise ValueError("target_ongoing_requests must be > 0; batch_wait_timeout_s and retry_after_s >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

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
        return asdict(self)


def serve_config_from_dict(values: dict[str, Any]) -> ServeConfig:
    return build_config(ServeConfig, values)


def load_serve_config(path: str | None = None, overrides: list[str] = ()) -> ServeConfig:
    """A ServeConfig from an optional YAML file plus ``key=value`` overrides."""
    return serve_config_from_dict(read_tree(path, overrides, "serve config"))

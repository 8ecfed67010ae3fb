"""Typed training configuration: a YAML recipe plus ``--set key=value`` overrides.

Every section is a strict pydantic model (train/schema.py) whose field docstrings are the text of
``python -m train --help``; ``load_config`` rejects unknown keys and bad values, naming the key and what
is allowed, before any Ray work starts.
"""

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from train import storage
from train.batching import check_batch_divides
from train.hf_gpt2 import check_weights, read_model_config
from train.model_config import ModelConfig
from train.schema import ConfigError, Name, Section, find_config_file, parse, read_tree, replace, shipped_names
from train.tokenizer import MAX_VOCAB, BPETokenizer, ByteTokenizer, load_tokenizer

RECIPE_DIR = Path(__file__).with_name("recipes")  # package data: the same in a checkout and in a wheel


# 1 GiB: a BPE trained on 31.5 MB of Python source in 4.6 s on 2 cores (~2.5 min for this); 100x that takes hours.
BPE_TRAIN_BYTES = 1 << 30


class DataConfig(Section):
    source: str = ""
    """Directory, glob, JSONL or Parquet of text; local or URI. "" = the Python standard library's source."""
    path: str = ""
    """Prepared dataset directory. "" = <run.storage_path>/datasets/<hash of the preparation settings>."""
    text_column: str = "text"
    """The text field of JSONL and Parquet sources."""
    val_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    """Share of documents held out for validation."""
    tokenizer: str = Field("byte", min_length=1)
    """byte (one token per byte, no setup), bpe (a byte-level BPE trained on the source by prepare), or the
    path of a tokenizer.json or of a Hugging Face model directory holding one."""
    vocab_size: int = Field(4096, ge=257, le=MAX_VOCAB)
    """Vocabulary of a trained BPE (data.tokenizer: bpe), all 256 bytes and end-of-text included."""
    bpe_train_bytes: int = Field(BPE_TRAIN_BYTES, ge=0)
    """Bytes of the training split that a trained BPE learns from, at most: documents sampled evenly by their
    content hash (the same on any machine). Training it runs in one process; 0 = the whole split."""


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(20, ge=0)
    """Steps of linear warm-up from 0 to lr."""
    max_steps: int = Field(200, ge=1)
    """Optimizer steps of the whole run."""
    weight_decay: float = Field(0.1, ge=0.0)
    """AdamW's decoupled weight decay, of the weight matrices and embeddings (not of biases and LayerNorms)."""
    betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2)
    """AdamW's beta1 and beta2, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW's epsilon."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    global_batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step, fixed whatever the worker count (accumulation makes up the rest)."""
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 8
    """Sequences per worker per forward/backward; auto: the largest that splits the global batch at every worker
    count, fits each worker's memory beside the model states (train/memory.py) and holds at most 32768 tokens."""

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _micro_batch_is_not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, str) and value != "auto"):  # true would be 1 to an int
            raise ValueError("must be a positive integer or auto")
        return value

    @property
    def smallest_micro_batch(self) -> int:
        """The micro-batch size, or for auto the smallest it can become."""
        return 1 if self.micro_batch_size == "auto" else self.micro_batch_size

    @model_validator(mode="after")
    def _consistent(self) -> "OptimConfig":
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be <= max_steps ({self.max_steps})")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        return self


class DeepSpeedConfig(Section):
    zero_stage: Literal[0, 1, 2, 3, "auto"] = 0
    """ZeRO stage: 0 replicates everything, 1 shards optimizer state, 2 also gradients, 3 also parameters;
    auto: the lowest stage whose model states and activations fit each worker's memory at the run's smallest
    size (train/memory.py), chosen when the run starts and kept for the run."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision (bf16 and fp16 keep fp32 master weights)."""
    offload_optimizer: bool = False
    """ZeRO 1-3: optimizer state and step on the CPU."""
    offload_params: bool = False
    """ZeRO 3 only: parameters on the CPU."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input through the forward pass and recompute the block's activations in
    the backward (torch.utils.checkpoint): activation memory falls from ~17 to ~1 value of the residual width per
    token per layer, for a second forward pass of the blocks (MFU counts the model's FLOPs, not the recompute)."""
    config_file: str = ""
    """A raw DeepSpeed JSON merged over the generated config (train/ds_config.py)."""

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_is_not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # true == 1: a Literal[0, 1, 2, 3] alone would take it
            raise ValueError("must be 0, 1, 2, 3 or auto")
        return value

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> "DeepSpeedConfig":
        if self.offload_optimizer and self.zero_stage in (0, "auto"):
            raise ValueError(f"offload_optimizer needs zero_stage 1, 2 or 3, not {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params needs zero_stage 3")
        return self


class ScalingConfig(Section):
    num_workers: int | list[int] = 1
    """A fixed worker count, or [min, max] for an elastic run."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); else CPU workers (gloo)."""
    cpus_per_worker: int = Field(1, ge=1)
    """CPUs each worker reserves; also its torch thread count."""
    resources_per_worker: dict[str, float] = {}
    """Custom Ray resources each worker asks for, e.g. {spot: 0.01} to run on spot nodes."""
    max_failures: int = Field(3, ge=0)
    """Real failures tolerated before the run stops; pre-emptions are unlimited."""
    resize_check_interval_s: float = Field(60.0, gt=0.0)
    """How often Ray Train looks for capacity to grow into."""
    worker_start_timeout_s: float = Field(30.0, gt=0.0)
    """How long a restart waits for the old size before shrinking."""
    health_check_interval_s: float = Field(0.5, gt=0.0)
    """Ray Train's controller poll, which takes one report per worker: its 2 s default slowed every report."""

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @model_validator(mode="after")
    def _worker_range(self) -> "ScalingConfig":
        not_a_range = isinstance(self.num_workers, list) and len(self.num_workers) != 2
        if not_a_range or not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"num_workers must be >= 1, or [min, max] with 1 <= min <= max; got {self.num_workers}")
        if any(amount <= 0 for amount in self.resources_per_worker.values()):
            raise ValueError(f"resources_per_worker must be > 0, got {self.resources_per_worker}")
        return self


class CheckpointConfig(Section):
    every_steps: int = Field(100, ge=0)
    """Steps between checkpoints; 0 disables step-based checkpoints."""
    every_minutes: float = Field(0.0, ge=0.0)
    """Minutes between checkpoints; 0 disables time-based checkpoints."""
    keep_last: int = Field(3, ge=1)
    """Complete checkpoints kept; older ones are deleted."""
    async_write: bool = True
    """Write checkpoint files (and upload them) on a background thread while training goes on; training
    waits only for a host copy of the state. The checkpoint counts once every worker's files are written;
    one is in flight at a time; a pre-emption's checkpoints and the last one are waited for."""
    failures_tolerated: int = Field(3, ge=0)
    """Checkpoints in a row that may fail to be written (storage unreachable, a full disk) while training goes on;
    the next failure, or a failure of the run's last checkpoint, stops the run with the error."""
    preemption_check_s: float = Field(5.0, gt=0.0)
    """How often to ask Ray whether a node is being pre-empted (a round trip through Ray Train, ~11 ms,
    and a broadcast); Ray itself learns of a drain every 5 s, so asking more often finds nothing sooner."""


class RunConfig(Section):
    name: Name = "tiny"
    """The run's directory name; re-running with the same name resumes the run."""
    storage_path: str = Field(default_factory=lambda: os.environ.get("RAYWRIGHT_STORAGE") or "runs")
    """Local directory or URI (s3://, gs://) that holds runs and prepared datasets; by default
    $RAYWRIGHT_STORAGE (cluster.yaml sets it on every node), else ./runs."""
    seed: int = 0
    """Seeds the model's initialization and the data order."""
    log_every: int = Field(10, ge=1)
    """Steps between metric reports; Ray Train takes one a scaling.health_check_interval_s, so more often than
    that holds training back (the run warns)."""
    eval_every: int = Field(50, ge=1)
    """Steps between validation passes (and one at the end)."""
    eval_samples: int = Field(256, ge=1)
    """Validation sequences per pass: the split's first ones (all of it, if it holds fewer), at any world size."""
    peak_tflops: float = Field(0.0, ge=0.0)
    """Per-device peak TFLOP/s for MFU; 0 = the known peak of the GPU, none on CPU."""
    ray_address: str = ""
    """The Ray cluster to run on; "" = the cluster of a Ray job, else a private local Ray."""
    sample_log: bool = False
    """Log the dataset rows each step trained on, to <run>/samples.jsonl."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the model (DeepSpeed's engine.compile()) when each worker builds its engine; auto = on GPUs
    at ZeRO stage 0 or 1 (+18% at stage 1 on an H100; no gain measured at stage 2), off on CPUs."""
    profile_steps: list[int] = []
    """[first, last]: profile these optimizer steps with torch.profiler on every rank (a Chrome trace each in
    <run>/profile/; rank 0 prints the top ops and how busy the device was); [] = no profiling."""
    side_files_upload_s: float = Field(30.0, gt=0.0)
    """On object storage, seconds between uploads of metrics.jsonl and TensorBoard (also uploaded with every
    checkpoint and at the end; the node keeps them meanwhile, and through a failed upload); on any storage, between
    saves of the steps to timeline.json, the elastic record a resuming driver continues."""
    storage_wait_s: float = Field(300.0, ge=0.0)
    """How long a (re)starting worker waits for the run's storage and dataset to answer before its attempt fails:
    a restart during a storage outage then costs the wait, not one of scaling.max_failures. The driver of a trained
    run waits as long to save the run's record."""
    lease_stale_after_s: float = Field(300.0, ge=10.0)
    """A run is refused while another driver holds its lease (<run>/lease.json); a lease without
    heartbeat for this long, or held by a process of this host that has exited, is taken over."""

    @field_validator("profile_steps")
    @classmethod
    def _step_range(cls, steps: list[int]) -> list[int]:
        if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
            raise ValueError("must be [] or [first, last] with 1 <= first <= last")
        return steps


class CostConfig(Section):
    price_per_hour: dict[str, float] = {}
    """Price of a node per hour by node type, e.g. {spot: 1.1, ondemand: 3.7}."""
    on_demand_type: str = "ondemand"
    """The node type whose price prices "on-demand only" in the run summary."""

    @model_validator(mode="after")
    def _priced(self) -> "CostConfig":
        if any(price < 0 for price in self.price_per_hour.values()):
            raise ValueError(f"price_per_hour must be >= 0, got {self.price_per_hour}")
        if self.price_per_hour and self.on_demand_type not in self.price_per_hour:
            raise ValueError(f"on_demand_type {self.on_demand_type!r} has no price in price_per_hour")
        return self


class TrainConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    cost: CostConfig = Field(default_factory=CostConfig)

    @model_validator(mode="after")
    def _sizes_fit_every_world_size(self) -> "TrainConfig":
        optim, scaling = self.optim, self.scaling
        micro = optim.smallest_micro_batch
        check_batch_divides(optim.global_batch_size, micro, scaling.min_workers, scaling.max_workers)
        if self.deepspeed.precision == "fp16" and not self.scaling.use_gpu:
            # DeepSpeed refuses fp16 on most CPUs ("Type fp16 is not supported on your device"), in every worker.
            raise ValueError(
                "deepspeed.precision fp16 needs GPU workers (scaling.use_gpu: true); CPU workers train in bf16 or fp32"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def recipe_names() -> list[str]:
    """The train recipes that ship with raywright (train/recipes/)."""
    return shipped_names(RECIPE_DIR)


def resolve_recipe(recipe: str) -> str:
    """A recipe is a YAML path or URI, or the name of a shipped recipe (``tiny`` -> train/recipes/tiny.yaml)."""
    return find_config_file(recipe, RECIPE_DIR, "recipe")


def load_config(recipe: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Load a recipe (name or path), apply ``--set`` overrides, validate everything, and resolve the model."""
    tree = read_tree(resolve_recipe(recipe) if recipe else None, overrides, "recipe")
    return resolve_model(parse(TrainConfig, tree))


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """The model that ``model.init_from`` and the tokenizer imply, read on the driver before Ray starts.

    With ``model.init_from``, its config.json gives the model's shape (dropout stays the recipe's)
    and its tokenizer becomes ``data.tokenizer``. Otherwise ``model.vocab_size`` is raised to the
    tokenizer's vocabulary where it is smaller (a larger one pads the embedding).
    """
    model, data = cfg.model, cfg.data
    if model.init_from:
        # Absolute: the workers read it too, from another working directory.
        init_from = storage.absolute(model.init_from)
        if data.tokenizer not in ("byte", init_from, model.init_from):
            raise ConfigError(
                f"data.tokenizer: a run from model.init_from uses that model's tokenizer; drop {data.tokenizer!r}"
            )
        try:
            shape = read_model_config(init_from)
            check_weights(init_from)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.init_from: {exc}") from None
        model = replace(shape, dropout=model.dropout, init_from=init_from)
        data = replace(data, tokenizer=init_from)
    if data.tokenizer == "bpe":
        vocab = data.vocab_size
    else:
        tokenizer = tokenizer_setting(data.tokenizer)
        if isinstance(tokenizer, ByteTokenizer):  # also a byte-level export's: it reuses byte-level datasets
            data = replace(data, tokenizer="byte")
        vocab = tokenizer.vocab_size
    if model.vocab_size < vocab:
        model = replace(model, vocab_size=vocab)
    return replace(cfg, model=model, data=data)


def tokenizer_setting(choice: str, key: str = "data.tokenizer") -> BPETokenizer:
    """The tokenizer that ``choice`` names (byte, a tokenizer.json or a model directory holding one), read
    before Ray starts; what cannot be read is a ConfigError naming ``key``."""
    try:
        return ByteTokenizer() if choice == "byte" else load_tokenizer(choice)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}") from None


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """Rebuild a validated config from ``to_dict`` output (checkpoint metadata, Ray workers)."""
    return parse(TrainConfig, values)

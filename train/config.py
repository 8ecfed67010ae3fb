"""Typed training configuration, loaded from a YAML recipe plus ``--set key=value`` overrides.

Every section is a dataclass; ``load_config`` rejects unknown keys and bad values
(naming the key and what is allowed) before any Ray work starts.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from train import storage
from train.batching import check_batch_divides
from train.hf_gpt2 import read_model_config, weight_files
from train.model import ModelConfig
from train.tokenizer import MAX_VOCAB, ByteTokenizer, load_tokenizer

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class DataConfig:
    source: str = ""  # directory, glob, JSONL or Parquet; local or URI; "" = the Python stdlib source
    path: str = ""  # prepared dataset directory; "" = data/<hash of the preparation settings>
    text_column: str = "text"  # for JSONL and Parquet sources
    val_fraction: float = 0.02  # share of documents held out for validation
    # byte (one token per byte, no setup), bpe (a byte-level BPE trained on the source by prepare),
    # or the path of a tokenizer.json or of a Hugging Face model directory holding one.
    tokenizer: str = "byte"
    vocab_size: int = 4096  # of a trained BPE (data.tokenizer: bpe), all 256 bytes and end-of-text included

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        if not 257 <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"data.vocab_size must be in [257, {MAX_VOCAB}], got {self.vocab_size}")
        if not self.tokenizer:
            raise ValueError("data.tokenizer must be byte, bpe or the path of a tokenizer")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 20
    max_steps: int = 200
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    global_batch_size: int = 32  # sequences per optimizer step, fixed whatever the worker count
    micro_batch_size: int = 8  # sequences per worker per forward/backward

    def validate(self) -> None:
        for key in ("lr", "eps"):
            if getattr(self, key) <= 0:
                raise ValueError(f"optim.{key} must be > 0, got {getattr(self, key)}")
        for key in ("max_steps", "global_batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"optim.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"optim.warmup_steps must be in [0, optim.max_steps], got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optim.weight_decay and optim.grad_clip must be >= 0")


@dataclass
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    offload_optimizer: bool = False  # ZeRO 1-3: optimizer state and step on the CPU
    offload_params: bool = False  # ZeRO 3 only: parameters on the CPU
    config_file: str = ""  # raw DeepSpeed JSON merged over the generated config

    def validate(self) -> None:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("deepspeed.offload_optimizer needs deepspeed.zero_stage 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_params needs deepspeed.zero_stage 3")
        if self.config_file and not Path(self.config_file).is_file():
            raise ValueError(f"deepspeed.config_file: no such file {self.config_file!r}")


@dataclass
class ScalingConfig:
    num_workers: int | list[int] = 1  # a fixed count, or [min, max] for an elastic run
    use_gpu: bool = False
    cpus_per_worker: int = 1  # also the torch thread count of each worker
    resources_per_worker: dict[str, float] = field(default_factory=dict)  # e.g. {"spot": 0.01}
    max_failures: int = 3  # real failures tolerated before the run stops; pre-emptions are unlimited
    resize_check_interval_s: float = 60.0  # how often Ray Train looks for capacity to grow into
    worker_start_timeout_s: float = 30.0  # how long a restart waits for the old size before shrinking
    health_check_interval_s: float = 0.5  # Ray Train's controller poll; its 2 s default slows reports

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    def validate(self) -> None:
        if isinstance(self.num_workers, list) and (
            len(self.num_workers) != 2 or not 1 <= self.num_workers[0] <= self.num_workers[1]
        ):
            raise ValueError(
                f"scaling.num_workers must be an int or [min, max] with 1 <= min <= max, got {self.num_workers}"
            )
        if self.min_workers < 1 or self.cpus_per_worker < 1 or self.max_failures < 0:
            raise ValueError("scaling.num_workers and scaling.cpus_per_worker must be >= 1, max_failures >= 0")
        for key in ("resize_check_interval_s", "worker_start_timeout_s", "health_check_interval_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"scaling.{key} must be > 0, got {getattr(self, key)}")


@dataclass
class CheckpointConfig:
    every_steps: int = 100  # 0 disables step-based checkpoints
    every_minutes: float = 0.0  # 0 disables time-based checkpoints
    keep_last: int = 3
    # How often to ask Ray whether a node is being pre-empted. Each check is a round trip through
    # Ray Train (~11 ms here), and Ray itself polls drain state only every 5 s.
    preemption_check_s: float = 2.0

    def validate(self) -> None:
        if self.every_steps < 0 or self.every_minutes < 0:
            raise ValueError("checkpoint.every_steps and checkpoint.every_minutes must be >= 0")
        if self.preemption_check_s <= 0:
            raise ValueError(f"checkpoint.preemption_check_s must be > 0, got {self.preemption_check_s}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class RunConfig:
    name: str = "tiny"  # re-running with the same name resumes the run
    storage_path: str = "runs"  # local directory or URI (s3://, gs://) holding runs
    seed: int = 0
    log_every: int = 10  # steps between metric reports
    eval_every: int = 50  # steps between validation passes (and one at the end)
    eval_samples: int = 256  # validation sequences per pass
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = known GPU peak, none on CPU
    ray_address: str = ""  # "" = start a local embedded Ray
    sample_log: bool = False  # log the dataset rows each step trained on, to <run>/samples.jsonl

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"run.name must be a non-empty name without '/', got {self.name!r}")
        for key in ("log_every", "eval_every", "eval_samples"):
            if getattr(self, key) < 1:
                raise ValueError(f"run.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class CostConfig:
    price_per_hour: dict[str, float] = field(default_factory=dict)  # node type -> price, e.g. {spot: 1.1}
    on_demand_type: str = "ondemand"  # the type whose price prices "on-demand only"

    def validate(self) -> None:
        if any(price < 0 for price in self.price_per_hour.values()):
            raise ValueError(f"cost.price_per_hour must be >= 0, got {self.price_per_hour}")
        if self.price_per_hour and self.on_demand_type not in self.price_per_hour:
            raise ValueError(f"cost.on_demand_type {self.on_demand_type!r} has no price in cost.price_per_hour")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cost: CostConfig = field(default_factory=CostConfig)

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        check_batch_divides(
            self.optim.global_batch_size,
            self.optim.micro_batch_size,
            self.scaling.min_workers,
            self.scaling.max_workers,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A recipe or override that names an unknown key or holds a bad value."""


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against the type hint ``hint``; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} is not a {_type_name(hint)}")
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: {value!r} is not a list of {_type_name(item_hint)}")
        return [_coerce(item, item_hint, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: {value!r} is not a mapping")
        return {str(k): _coerce(v, value_hint, f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is a subclass of int in Python, but `true` is never a valid count or rate.
    if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: {value!r} is not a {_type_name(hint)}")
    return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def build_dataclass(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """``cls`` built from nested ``values``; unknown keys and mistyped values raise ConfigError.

    ``prefix`` is the dotted section name used in error messages. Shared by every config of
    raywright (training, serving, sweeps) so that all of them fail the same way.
    """
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown key {prefix}{key}; {prefix.rstrip('.') or 'top level'} allows: {sorted(known)}")
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{prefix}{key} must be a mapping of {sorted(f.name for f in dataclasses.fields(hint))}"
                )
            kwargs[key] = build_dataclass(hint, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hint, f"{prefix}{key}")
    return cls(**kwargs)


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """``build_dataclass`` then the config's own ``validate()``, whose ValueError becomes a ConfigError."""
    config = build_dataclass(cls, values)
    try:
        config.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return config


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply ``section.key=value`` to the nested dict ``tree``; the value is parsed as YAML."""
    path, sep, raw = override.partition("=")
    if not sep or not path:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[leaf] = yaml.safe_load(raw) if raw else ""


def read_tree(path: str | None, overrides: list[str], what: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (none: empty) with ``key=value`` overrides applied.

    ``what`` names the kind of file in errors ("serve config", "sweep config").
    """
    tree: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: a {what} must be a mapping of keys")
    for override in overrides:
        apply_override(tree, override)
    return tree


def recipe_names() -> list[str]:
    """The train recipes in configs/ (sweep-*.yaml there are sweeps, see tune/config.py)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not p.stem.startswith("sweep-"))


def resolve_recipe(recipe: str) -> Path:
    """A recipe is a YAML path, or the name of a file in configs/ (``tiny`` -> configs/tiny.yaml)."""
    path = Path(recipe)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise ConfigError(f"no recipe {recipe!r} (looked for {path}); recipes in configs/: {recipe_names()}")
    return path


def load_config(recipe: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Load a recipe (name or path), apply ``--set`` overrides, validate everything, and resolve the model."""
    tree = read_tree(str(resolve_recipe(recipe)) if recipe else None, overrides, "recipe")
    return resolve_model(build_config(TrainConfig, tree))


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """The model that ``model.init_from`` and the tokenizer imply, read on the driver before Ray starts.

    With ``model.init_from``, its config.json gives the model's shape (dropout stays the recipe's)
    and its tokenizer becomes ``data.tokenizer``. Otherwise ``model.vocab_size`` is raised to the
    tokenizer's vocabulary where it is smaller (a larger one pads the embedding).
    """
    model, data = cfg.model, cfg.data
    if model.init_from:
        # Absolute: the workers read it too, from another working directory.
        model = dataclasses.replace(model, init_from=storage.absolute(model.init_from))
        if data.tokenizer not in ("byte", model.init_from, cfg.model.init_from):
            raise ConfigError(
                f"data.tokenizer: a run from model.init_from uses that model's tokenizer; drop {data.tokenizer!r}"
            )
        try:
            shape = read_model_config(model.init_from)
            weight_files(model.init_from)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.init_from: {exc}") from None
        model = dataclasses.replace(shape, dropout=model.dropout, init_from=model.init_from)
        data = dataclasses.replace(data, tokenizer=model.init_from)
    if data.tokenizer == "bpe":
        vocab = data.vocab_size
    else:
        try:
            tokenizer = ByteTokenizer() if data.tokenizer == "byte" else load_tokenizer(data.tokenizer)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"data.tokenizer: {exc}") from None
        if isinstance(tokenizer, ByteTokenizer):  # also a byte-level export's: it reuses byte-level datasets
            data = dataclasses.replace(data, tokenizer="byte")
        vocab = tokenizer.vocab_size
    if model.vocab_size < vocab:
        model = dataclasses.replace(model, vocab_size=vocab)
    return dataclasses.replace(cfg, model=model, data=data)


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """Rebuild a validated config from ``to_dict`` output (checkpoint metadata, Ray workers)."""
    return build_config(TrainConfig, values)

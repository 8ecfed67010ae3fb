"""A sweep, declared in YAML: the base training recipe, the search space, the search and its resources.

    name: tiny-lr
    base: tiny                        # the train recipe every trial starts from
    set: [optim.max_steps=60]         # overrides of the base for every trial
    space:
      optim.lr: {loguniform: [1.0e-4, 1.0e-2]}
      optim.warmup_steps: {int: [0, 20]}
      model.d_model: {choice: [64, 128]}
    num_trials: 8
    max_concurrent_trials: 2

Every value the space can take is checked against the training config before anything runs,
so a bad parameter fails with its name instead of in the middle of a sweep.
"""

import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ray import tune

from train.config import ConfigError, TrainConfig, build_config, load_config, read_tree

KINDS = ("loguniform", "uniform", "int", "choice")
MAX_COMBINATIONS_CHECKED = 512


@dataclass
class SweepConfig:
    name: str = "sweep"
    base: str = "tiny"  # train recipe: a name in configs/ or a YAML path
    set: list[str] = field(default_factory=list)  # section.key=value overrides of the base, for every trial
    space: dict[str, dict] = field(
        default_factory=dict
    )  # section.key -> {loguniform|uniform|int: [lo, hi]} or {choice: [...]}
    num_trials: int = 8
    max_concurrent_trials: int = 2
    seed: int = 0
    search: Literal["tpe", "random"] = "tpe"
    # Random trials before TPE models the space; Optuna's default (10) is a whole small sweep.
    tpe_startup_trials: int = 4
    early_stopping: Literal["asha", "none"] = "asha"
    grace_period: int = 10  # steps every trial trains before ASHA may stop it
    reduction_factor: int = 2  # ASHA keeps the best 1/reduction_factor of the trials at each rung
    metric: Literal["val_loss"] = "val_loss"
    # 1: the trial trains in its own process. More: the trial runs a Ray Train DeepSpeed job of that many
    # workers (Train inside Tune; ~40 s more start-up per trial).
    trial_workers: int = 1
    # What one training process asks for: the trial's own with one worker, each Train worker's with more.
    trial_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0, "spot": 0.01})
    max_failures: int = 3  # restarts of one trial (node lost, pre-empted) before it counts as failed
    storage_path: str = ""  # "" = the base recipe's run.storage_path; results go to <storage>/sweeps/<name>
    ray_address: str = ""  # "" = a private local Ray; "auto" or ray://... to use a cluster
    recipe_dir: str = ""  # where best-<name>.yaml goes; "" = this project's configs/

    def validate(self) -> None:
        for key in ("num_trials", "max_concurrent_trials", "grace_period", "tpe_startup_trials", "trial_workers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.reduction_factor < 2:
            raise ValueError(f"reduction_factor must be >= 2, got {self.reduction_factor}")
        if not self.space:
            raise ValueError("space: declare at least one parameter, e.g. optim.lr: {loguniform: [1e-4, 1e-2]}")
        if any(amount < 0 for amount in self.trial_resources.values()):
            raise ValueError(f"trial_resources must be >= 0, got {self.trial_resources}")
        # Ray rejects a zero resource request ("empty bundle"): ask for a sliver of `spot` instead.
        if any(amount == 0 for amount in self.trial_resources.values()):
            raise ValueError("trial_resources: a resource of 0 is rejected by Ray; use e.g. 0.01, or leave it out")

    @property
    def on_ray_train(self) -> bool:
        """Whether each trial runs a Ray Train job (more than one worker) rather than the loop in-process."""
        return self.trial_workers > 1

    def base_config(self, extra: list[str] = ()) -> TrainConfig:
        """The base recipe with ``set`` and ``extra`` applied, on ``trial_workers`` workers."""
        return load_config(self.base, [f"scaling.num_workers={self.trial_workers}", *self.set, *extra])

    def storage_root(self) -> str:
        """Where sweeps go: ``storage_path``, else the base recipe's ``run.storage_path``."""
        return self.storage_path or self.base_config().run.storage_path

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def override(key: str, value: Any) -> str:
    """``key=value`` as a ``--set`` override (values are parsed as YAML, which JSON is)."""
    return f"{key}={json.dumps(value)}"


def _candidates(key: str, spec: Any) -> list[Any]:
    """The values of one parameter worth checking: the bounds of a range, every choice."""
    where = f"space.{key}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"{where}: expected one of {{{' | '.join(KINDS)}: ...}}, got {spec!r}")
    ((kind, args),) = spec.items()
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}: choice needs a non-empty list of values, got {args!r}")
        return args
    number = int if kind == "int" else (int, float)
    if not (isinstance(args, list) and len(args) == 2 and all(isinstance(a, number) for a in args)):
        raise ConfigError(f"{where}: {kind} needs [low, high] as two {'integers' if kind == 'int' else 'numbers'}")
    low, high = args
    if not low < high or (kind == "loguniform" and low <= 0):
        raise ConfigError(f"{where}: {kind} needs 0 < low < high" if kind == "loguniform" else f"{where}: low < high")
    return [low, high]


def check_space(sweep: SweepConfig) -> None:
    """Raise ConfigError naming the parameter if any value of the space makes an invalid training config."""
    try:
        base = sweep.base_config()
    except ConfigError as exc:
        raise ConfigError(f"base {sweep.base!r} with set {sweep.set}: {exc}") from None
    if base.scaling.num_workers != sweep.trial_workers or "scaling.num_workers" in sweep.space:
        # A fixed worker count per trial: ASHA compares trials at equal steps of an equal global batch.
        raise ConfigError("scaling.num_workers: set the workers of every trial with trial_workers, not in set or space")
    candidates = {key: _candidates(key, spec) for key, spec in sweep.space.items()}
    for key, values in candidates.items():
        for value in values:
            try:
                sweep.base_config([override(key, value)])
            except ConfigError as exc:
                raise ConfigError(f"space.{key}: value {value!r} gives an invalid training config: {exc}") from None
    # Parameters can be valid alone and not together (batch sizes that do not divide): check combinations.
    combinations = list(itertools.islice(itertools.product(*candidates.values()), MAX_COMBINATIONS_CHECKED))
    for values in combinations:
        try:
            sweep.base_config([override(k, v) for k, v in zip(candidates, values, strict=True)])
        except ConfigError as exc:
            combo = dict(zip(candidates, values, strict=True))
            raise ConfigError(f"space: the combination {combo} gives an invalid training config: {exc}") from None


def tune_space(space: dict[str, dict]) -> dict[str, Any]:
    """The space as Ray Tune search domains (OptunaSearch converts them to Optuna distributions)."""
    domains = {}
    for key, spec in space.items():
        ((kind, args),) = spec.items()
        if kind == "choice":
            domains[key] = tune.choice(args)
        elif kind == "int":
            domains[key] = tune.randint(args[0], args[1] + 1)  # inclusive of high, as written
        else:
            domains[key] = (tune.loguniform if kind == "loguniform" else tune.uniform)(*args)
    return domains


def sweep_config_from_dict(values: dict[str, Any]) -> SweepConfig:
    sweep = build_config(SweepConfig, values)
    check_space(sweep)
    return sweep


def load_sweep_config(path: str, overrides: list[str] = ()) -> SweepConfig:
    return sweep_config_from_dict(read_tree(path, overrides, "sweep config"))

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
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from train import storage
from train.config import TrainConfig, load_config
from train.schema import (
    ConfigError,
    Name,
    Section,
    error_reason,
    find_config_file,
    load_yaml,
    parse,
    read_tree,
    shipped_names,
)

SWEEP_DIR = Path(__file__).with_name("sweeps")  # package data, like train/recipes/
SWEEP_FILE = "sweep.yaml"  # in a sweep's directory: the settings it started with
KINDS = ("loguniform", "uniform", "int", "choice")
MAX_COMBINATIONS_CHECKED = 512


class SweepConfig(Section):
    name: Name = "sweep"
    """The sweep's directory name: results go to <storage_path>/sweeps/<name>."""
    base: str = "tiny"
    """The train recipe every trial starts from: a shipped recipe's name or a YAML path."""
    set: list[str] = []
    """section.key=value overrides of the base, for every trial."""
    space: dict[str, dict[str, Any]] = Field(min_length=1)
    """section.key -> {loguniform|uniform|int: [low, high]} or {choice: [...]}, e.g.
    optim.lr: {loguniform: [1e-4, 1e-2]}."""
    num_trials: int = Field(8, ge=1)
    """Trials in the sweep."""
    max_concurrent_trials: int = Field(2, ge=1)
    """Trials running at once."""
    seed: int = 0
    """Seeds the sampler: the same seed proposes the same trials."""
    search: Literal["tpe", "random"] = "tpe"
    """Optuna's TPE, or random search."""
    tpe_startup_trials: int = Field(10, ge=1)
    """Random trials before TPE models the space (Optuna's default; a sweep of a few trials wants fewer)."""
    tpe_random_fraction: float = Field(1 / 3, ge=0, lt=1)
    """Of TPE's proposals after the start-up, this fraction is drawn at random (BOHB's 1/3), so that TPE
    does not lock on the region of the first trials that did well."""
    tpe_multivariate: bool = True
    """TPE models the parameters jointly (learning rate and width interact), not one at a time."""
    tpe_constant_liar: bool = True
    """TPE counts running trials as bad results, so concurrent trials are not proposed on top of each other."""
    early_stopping: Literal["asha", "none"] = "asha"
    """ASHA stops trials that fall behind at its rungs; none runs every trial to the end."""
    grace_period: int = Field(20, ge=1)
    """Steps every trial trains before ASHA may stop it; at least the longest learning-rate warm-up the
    base and space allow, so that no trial is judged while its learning rate is still rising."""
    reduction_factor: int = Field(3, ge=2)
    """ASHA keeps the best 1/reduction_factor of the trials at each rung."""
    step_budget: int = Field(0, ge=0)
    """End the sweep once its trials have trained this many steps in all (0: no limit). With ASHA the
    steps, not the trials, are what a sweep costs; num_trials then only caps the count. A resumed sweep
    goes on counting where it was interrupted (Tune keeps the count in the sweep's state)."""
    target: float | None = None
    """End the sweep once a trial's metric reaches this value (None: run to the end)."""
    metric: Literal["val_loss"] = "val_loss"
    """What the sweep minimizes."""
    trial_workers: int = Field(1, ge=1)
    """1: a trial trains in its own process. More: a trial is a Ray Train DeepSpeed job of that many workers
    (Train inside Tune; ~40 s more start-up per trial)."""
    trial_resources: dict[str, float] = {"CPU": 1.0, "spot": 0.01}
    """What one training process asks for: the trial's own with one worker, each Train worker's with more.
    A resource no node of a local Ray has (spot) is dropped there with a warning."""
    keep_trial_checkpoints: bool = False
    """Keep the checkpoints of trials that have ended. false: deleted once a trial has finished, been
    stopped early or been cut short by step_budget/target (nothing resumes those); its export, if it finished, stays."""
    max_failures: int = Field(3, ge=0)
    """Restarts of one trial (node lost, pre-empted) before it counts as failed."""
    storage_path: str = ""
    """Where sweeps go; "" = the base recipe's run.storage_path."""
    ray_address: str = ""
    """"" = a private local Ray; "auto" or ray://... to use a cluster."""
    best_recipe_path: str = ""
    """Also write the best recipe to this YAML path; it is always in the sweep directory."""

    @model_validator(mode="after")
    def _resources(self) -> "SweepConfig":
        # Ray rejects a zero resource request ("empty bundle"): ask for a sliver of `spot` instead.
        if any(amount <= 0 for amount in self.trial_resources.values()):
            raise ValueError(
                f"trial_resources must be > 0 (Ray rejects 0; use e.g. 0.01, or leave it out), "
                f"got {self.trial_resources}"
            )
        return self

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

    @property
    def storage_setting(self) -> str:
        """The setting that says where sweeps go, for errors about that place."""
        return "storage_path" if self.storage_path else "run.storage_path"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


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
    longest_warmup = max(candidates.get("optim.warmup_steps", [base.optim.warmup_steps]))
    if sweep.early_stopping == "asha" and sweep.grace_period < longest_warmup:
        raise ConfigError(
            f"grace_period: {sweep.grace_period} steps would judge trials still warming up "
            f"(optim.warmup_steps up to {longest_warmup}); make it at least {longest_warmup}"
        )
    if sweep.early_stopping == "asha" and sweep.grace_period >= base.optim.max_steps:
        raise ConfigError(
            f"grace_period: {sweep.grace_period} steps is not below optim.max_steps ({base.optim.max_steps}), "
            "so ASHA would never stop a trial; lower it or set early_stopping: none"
        )
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


def _check_trials_fit_the_space(sweep: SweepConfig) -> None:
    """A space of choices and integers only holds a finite number of settings: trials beyond it would train a
    setting again, on the same seed, to the same result."""
    sizes = {}
    for key, spec in sweep.space.items():
        ((kind, args),) = spec.items()
        if kind not in ("choice", "int"):
            return  # a continuous parameter: as many settings as trials
        sizes[key] = len(args) if kind == "choice" else args[1] - args[0] + 1
    settings = math.prod(sizes.values())
    if sweep.num_trials > settings:
        counted = " × ".join(f"{key}: {size}" for key, size in sizes.items())
        raise ConfigError(
            f"num_trials: {sweep.num_trials} trials of a space of {settings} distinct settings ({counted}) would "
            f"train some settings twice, on the same seed; set num_trials to at most {settings}, or widen space"
        )


def sweep_config_from_dict(values: dict[str, Any], new: bool = True) -> SweepConfig:
    """The sweep ``values`` declare, checked; ``new``: one about to start, whose trials must fit its space (a sweep
    saved before raywright checked that resumes as it started)."""
    sweep = parse(SweepConfig, values)
    check_space(sweep)
    if new:
        _check_trials_fit_the_space(sweep)
    return sweep


def sweep_names() -> list[str]:
    """The sweeps that ship with raywright (tune/sweeps/)."""
    return shipped_names(SWEEP_DIR)


def resolve_sweep(sweep: str) -> str:
    """A sweep file is a YAML path or URI, or the name of a shipped sweep (``tiny`` -> tune/sweeps/tiny.yaml)."""
    return find_config_file(sweep, SWEEP_DIR, "sweep")


def load_sweep_config(sweep: str, overrides: list[str] = ()) -> SweepConfig:
    return sweep_config_from_dict(read_tree(resolve_sweep(sweep), overrides, "sweep config"))


def resume_command(path: str) -> str:
    """The command that resumes the sweep in directory ``path``: its unfinished trials, and its failed ones."""
    return f"python -m tune --resume {path}"


def saved_sweep_config(path: str) -> SweepConfig:
    """The settings the sweep in directory ``path`` started with (its sweep.yaml): what ``--resume`` runs on."""
    saved = storage.join(path, SWEEP_FILE)
    try:
        text = storage.read_if_exists(saved)
    except OSError as exc:  # storage that cannot be reached
        raise ConfigError(f"--resume: cannot read {path}: {error_reason(exc)}") from None
    if text is None:
        raise ConfigError(f"--resume: {path} holds no {SWEEP_FILE}; is it a sweep directory?")
    return sweep_config_from_dict(load_yaml(text.decode(), saved), new=False)

"""Run, resume and summarize a sweep: Ray Tune + Optuna (TPE, seeded) + ASHA over the real training loop.

    result = run_sweep("tiny", {"optim.lr": {"loguniform": [1e-4, 1e-2]}}, name="lr", num_trials=8)
    result.trials          # a DataFrame, one row per trial
    result.best            # BestTrial: trial_id, val_loss, steps, params ({"optim.lr": ...})
    result.best_recipe     # <sweep dir>/best-lr.yaml: `python -m train --config <that path>`

Results live in ``<storage>/sweeps/<name>/``: Tune's experiment state (``resume_sweep`` picks it
up, Optuna's state, ASHA's rungs and finished trials included), each trial's training run under ``trials/``,
``trials.csv``, the plots, and a copy of the best recipe.
"""

import io
import logging
import os
import posixpath
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow.fs as pafs
import ray
import yaml
from ray import tune
from ray.tune import Callback, ExperimentAnalysis, ResultGrid
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.stopper import Stopper
from ray.util.state import list_actors

from train import checkpoint, storage
from train.cli import CommandFailed, take_sigterm_as_ctrl_c
from train.config import TrainConfig
from train.data import dataset_path
from train.launch import ensure_dataset, init_ray, resources_offered
from train.preflight import check_before_ray, check_storage
from train.schema import ConfigError, replace
from train.shared_storage import check_nodes_share, dataset_setting, shared_folder
from tune.asha import AshaRungs
from tune.config import SWEEP_FILE, SweepConfig, resume_command, saved_sweep_config, sweep_config_from_dict
from tune.plots import save_plots
from tune.progress import NotebookProgress, in_notebook
from tune.search import ExploringTPESampler, StepAwareOptunaSearch
from tune.trial import record_ended, run_trial, sweep_dir, trial_config, trials_dir

logger = logging.getLogger(__name__)

TRIALS_FILE = "trials.csv"  # written once a sweep has finished (``summarize``)
BEST_RECIPE_HEADER = "# Best of sweep "  # how a best recipe begins: a sweep overwrites no other file
TRIAL_PROCESSES = {"ImplicitFunc", "RayTrainWorker"}  # Tune's function trials and their Ray Train workers


@dataclass(frozen=True)
class BestTrial:
    """The sweep's best trial, as ``_best`` picks it: the lowest final ``val_loss``, of the trials that trained to
    ``optim.max_steps`` where any did."""

    trial_id: str
    val_loss: float
    steps: int
    params: dict[str, Any]  # its value of each key of the search space, e.g. {"optim.lr": 0.003}

    @classmethod
    def of_row(cls, row: pd.Series, space_keys: list[str]) -> "BestTrial":
        values = row.to_dict()  # Python's numbers, not numpy's (which YAML and JSON cannot write)
        return cls(values["trial_id"], values["val_loss"], values["steps"], {key: values[key] for key in space_keys})


@dataclass(frozen=True)
class FailedTrial:
    """A trial that failed more than ``max_failures`` times; ``--resume`` runs it again."""

    trial_id: str
    error: str  # the last line of its error: the exception and its message
    error_file: str  # the whole traceback, in the sweep directory


class SweepFailed(CommandFailed):
    """No trial of the sweep reported its metric: there is nothing to summarize."""


@dataclass
class SweepResult:
    path: str  # the sweep directory
    trials: pd.DataFrame
    best: BestTrial
    best_recipe: str  # path of the train recipe with the best parameters
    plots: list[str]
    curves: dict[str, pd.DataFrame]  # trial id -> its evaluations: step, metric, time
    failed: list[FailedTrial]


# With Train workers the trial's process only drives them: a sliver of CPU, on any node (the head too, which
# outlives spot nodes); Tune does not count the workers' resources, Train waits for them.
TRAIN_TRIAL_CPU = 0.01


def _trainable(sweep: SweepConfig, stop_on_sigterm: bool):
    storage_key, storage_root = sweep.storage_setting, sweep.storage_root()  # as given, before storage_path is set
    # Absolute paths for the trials: Tune runs each in a working directory of its own.
    sweep = replace(sweep, storage_path=storage.absolute(storage_root))
    address = [f"run.ray_address={sweep.ray_address}"] if sweep.ray_address else []
    cfg = sweep.base_config([f"run.storage_path={sweep.storage_path}", *address])
    check_before_ray(cfg)
    check_best_recipe_path(sweep)
    # A private Ray holds its concurrent trials: a Train trial's sliver beside its workers' CPUs (which alone
    # sized it before, so a 2-worker trial on a 2-core laptop waited for its workers forever).
    if init_ray(cfg, min_cpus=sweep.max_concurrent_trials * trial_cpus(sweep, cfg)):
        # A resource no node has (spot, on a laptop) would keep trials pending forever.
        sweep = replace(sweep, trial_resources=resources_offered(sweep.trial_resources, "trial_resources"))
    else:
        check_nodes_share([(storage_key, sweep.storage_path), dataset_setting(cfg, storage_key)])
    if stop_on_sigterm:  # Tune then saves the sweep's state and stops its trials
        take_sigterm_as_ctrl_c()
    data_path, manifest = ensure_dataset(cfg, storage_key)  # prepared once by the driver, read by every trial
    data_path = storage.absolute(data_path)
    # The trials look for the sweep's settings file (written before they start; a resumed sweep's is there).
    shared = shared_folder(storage_key, storage_root, storage.join(sweep_dir(sweep), SWEEP_FILE))
    trainable = tune.with_parameters(
        run_trial, sweep=sweep, data_path=data_path, manifest=manifest, shared_folder=shared
    )
    return tune.with_resources(trainable, _trial_process_resources(sweep)), data_path


def _trial_process_resources(sweep: SweepConfig) -> dict[str, float]:
    return {"CPU": TRAIN_TRIAL_CPU} if sweep.on_ray_train else sweep.trial_resources


def trial_cpus(sweep: SweepConfig, cfg: TrainConfig) -> float:
    """The CPUs one trial holds: its process's, and a Train trial's workers' (``trial_resources`` each, its CPU
    winning over ``scaling.cpus_per_worker``)."""
    cpus = _trial_process_resources(sweep).get("CPU", 0.0)
    if sweep.on_ray_train:
        cpus += sweep.trial_workers * sweep.trial_resources.get("CPU", cfg.scaling.cpus_per_worker)
    return cpus


class SweepBudget(Stopper):
    """Ends the sweep once its trials have trained ``step_budget`` steps in all, or one reached ``target``.
    Steps a trial redoes after resuming from its checkpoint are not counted again."""

    def __init__(self, sweep: SweepConfig):
        self.metric, self.step_budget, self.target = sweep.metric, sweep.step_budget, sweep.target
        self.last_step: dict[str, int] = {}
        self.spent = 0
        self.best = float("inf")

    def __call__(self, trial_id: str, result: dict) -> bool:
        step = result["step"]
        self.spent += max(0, step - self.last_step.get(trial_id, 0))
        self.last_step[trial_id] = max(step, self.last_step.get(trial_id, 0))
        self.best = min(self.best, result.get(self.metric, float("inf")))
        return False  # trials are ASHA's to stop; this only ends the whole sweep

    def count_restored(self, trials: list[Trial]) -> "SweepBudget":
        """Counts what ``trials``, of a saved sweep, reported last (their steps, their evaluations)."""
        for trial in trials:
            if "step" in trial.last_result:
                self(trial.trial_id, trial.last_result)
        return self

    def stop_all(self) -> bool:
        spent_all = 0 < self.step_budget <= self.spent
        return spent_all or (self.target is not None and self.best <= self.target)


class DropEndedTrialCheckpoints(Callback):
    """Deletes a trial's checkpoints once it has ended for good: finished, stopped by ASHA, or cut short by
    the sweep's step budget or target. They exist to resume the trial, and Tune never resumes an ended one;
    kept, a sweep of the `small` recipe would hold up to three 1.8 GB checkpoints per trial. What else the
    trial wrote (its export, if it finished) stays; trials an interrupted sweep leaves running keep theirs."""

    def __init__(self, sweep: SweepConfig):
        self.sweep = sweep
        # Whether the sweep's stopper ended the sweep, counted here from what it counts. Tune restores the
        # stopper's count with a resumed sweep's state, but callbacks as they were when the sweep began.
        self.budget = SweepBudget(sweep)
        self.counted_restored = False
        self.ended: set[str] = set()

    def on_step_begin(self, iteration: int, trials: list[Trial], **info) -> None:
        if self.counted_restored:
            return
        # Once, before the first step starts a trial (a started trial's last_result waits for its actor).
        self.counted_restored = True
        self.budget.count_restored(trials)

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict, **info) -> None:
        self.budget(trial.trial_id, result)

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info) -> None:
        self.ended.add(trial.trial_id)
        try:  # before its checkpoints go: a sweep resumed from a state saved before now must not train it again
            record_ended(self._run(trial.trial_id), trial.last_result)
        except OSError as exc:
            logger.warning("could not record that trial %s ended: %s", trial.trial_id, exc)
        self._drop(trial.trial_id)

    def on_experiment_end(self, trials: list[Trial], **info) -> None:
        # Tune ends the running trials the same way when the budget is spent and when the sweep is
        # interrupted; only the first are over. An errored trial is resumed by `--resume`.
        if self.budget.stop_all():
            self.ended |= {trial.trial_id for trial in trials if trial.status != Trial.ERROR}
        _wait_for_trial_processes()
        for trial_id in sorted(self.ended):
            self._drop(trial_id)  # again: a stopped trial's process may have written one after it ended

    def _run(self, trial_id: str) -> str:
        return storage.join(trials_dir(self.sweep), trial_id)

    def _drop(self, trial_id: str) -> None:
        try:
            checkpoint.prune(self._run(trial_id), keep_last=0)
        except OSError as exc:  # never fail a trial or the sweep over it; the sweep's end tries again
            logger.warning("could not delete the checkpoints of ended trial %s: %s", trial_id, exc)


def _wait_for_trial_processes(timeout_s: float = 30.0) -> None:
    """Wait until this sweep's trial processes have exited (at most ``timeout_s``). Tune asks a trial to
    stop and ends the sweep without waiting for that; a trial trains on to its next report meanwhile,
    and may write a checkpoint."""
    context = ray.get_runtime_context()
    job, address = context.get_job_id(), context.gcs_address  # this Ray's, not the one `ray start` last wrote
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            alive = list_actors(
                address, filters=[("job_id", "=", job), ("state", "=", "ALIVE")], raise_on_missing_output=False
            )
            if not any(name in actor.class_name for actor in alive for name in TRIAL_PROCESSES):
                return
            time.sleep(0.5)
    except Exception as exc:  # the state API needs Ray's dashboard; without it, do not wait
        logger.warning("could not see whether the trials have exited: %s", exc)


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


def _tuner_parts(sweep: SweepConfig):
    max_steps = sweep.base_config().optim.max_steps  # the space may not change it: rungs are in steps
    if sweep.search == "tpe":
        sampler = ExploringTPESampler(
            random_fraction=sweep.tpe_random_fraction,
            seed=sweep.seed,
            n_startup_trials=sweep.tpe_startup_trials,
            multivariate=sweep.tpe_multivariate,
            constant_liar=sweep.tpe_constant_liar,
        )
        optuna_search = StepAwareOptunaSearch(metric=sweep.metric, mode="min", sampler=sampler, max_steps=max_steps)
        searcher = ConcurrencyLimiter(optuna_search, sweep.max_concurrent_trials)
    else:
        searcher = BasicVariantGenerator(random_state=sweep.seed, max_concurrent=sweep.max_concurrent_trials)
    scheduler = (
        ASHAScheduler(
            time_attr="step",
            metric=sweep.metric,
            mode="min",
            max_t=max_steps,
            grace_period=sweep.grace_period,
            reduction_factor=sweep.reduction_factor,
            stop_last_trials=False,  # a trial at its last step ends itself, after its last checkpoint and export
        )
        if sweep.early_stopping == "asha"
        else FIFOScheduler()
    )
    return searcher, scheduler


def run_sweep(base_config: str, search_space: dict[str, dict], **options: Any) -> SweepResult:
    """Sweep ``search_space`` over the train recipe ``base_config``; ``options`` are SweepConfig fields."""
    return run_sweep_config(sweep_config_from_dict({"base": base_config, "space": search_space, **options}))


def run_sweep_config(sweep: SweepConfig, stop_on_sigterm: bool = False) -> SweepResult:
    """Run ``sweep``. One of the same name that already ran with the same settings is not started over (seeded,
    it would propose and train the same trials): one that finished with no trial failed gives its summary, without
    Ray; one that was interrupted, or had trials fail, resumes as ``resume_sweep`` does, as a training run does.
    ``stop_on_sigterm``: the command line's sweep, which a SIGTERM (``ray job stop``) interrupts as Ctrl-C does."""
    check_storage(sweep.storage_root(), sweep.storage_setting)  # before its earlier sweep is looked for there
    path = sweep_dir(sweep)
    if _ran_with(sweep, path):
        if _nothing_to_resume(path):
            print(f"sweep {sweep.name!r} already ran with these settings: its summary (give a new name to sweep again)")
            return _summary_from_files(sweep, path)
        if tune.Tuner.can_restore(path):
            print(
                f"sweep {sweep.name!r} ran with these settings and left trials unfinished or failed: resuming it "
                "(give a new name to sweep again)"
            )
            return resume_sweep(path, sweep, stop_on_sigterm)
    trainable, data_path = _trainable(sweep, stop_on_sigterm)
    if storage.exists(storage.join(path, TRIALS_FILE)):  # left by an earlier sweep of this name: this one runs now
        storage.delete_file(storage.join(path, TRIALS_FILE))
    # In the order given: a summary made from it (a resumed sweep's) has the columns of the sweep's own.
    storage.write_bytes(storage.join(path, SWEEP_FILE), yaml.safe_dump(sweep.to_dict(), sort_keys=False).encode())
    searcher, scheduler = _tuner_parts(sweep)
    tuner = tune.Tuner(
        trainable,
        param_space=tune_space(sweep.space),
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            scheduler=scheduler,
            num_samples=sweep.num_trials,  # the searcher limits how many run at once (max_concurrent_trials)
        ),
        run_config=tune.RunConfig(
            name=sweep.name,
            storage_path=storage.absolute(storage.join(sweep.storage_root(), "sweeps")),
            failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
            stop=SweepBudget(sweep),
            callbacks=_callbacks(sweep, scheduler),
        ),
    )
    return summarize(sweep, _ran_to_its_end(sweep, tuner.fit()), data_path)


def _callbacks(sweep: SweepConfig, scheduler: ASHAScheduler | FIFOScheduler) -> list[Callback]:
    progress = [NotebookProgress(sweep.metric, list(sweep.space))] if in_notebook() else []
    rungs = [AshaRungs(scheduler)] if isinstance(scheduler, ASHAScheduler) else []
    return progress + rungs + ([] if sweep.keep_trial_checkpoints else [DropEndedTrialCheckpoints(sweep)])


def resume_sweep(path: str, sweep: SweepConfig | None = None, stop_on_sigterm: bool = False) -> SweepResult:
    """Finish an interrupted sweep: finished trials are kept, unfinished ones resume from their checkpoints.
    ``sweep``: its saved settings (``saved_sweep_config``), where the caller has read them already;
    ``stop_on_sigterm`` as for ``run_sweep_config``."""
    sweep = sweep or saved_sweep_config(path)
    if _nothing_to_resume(path):
        return _summary_from_files(sweep, path)
    trainable, data_path = _trainable(sweep, stop_on_sigterm)
    tuner = tune.Tuner.restore(storage.absolute(path), trainable=trainable, resume_unfinished=True, resume_errored=True)
    return summarize(sweep, _ran_to_its_end(sweep, tuner.fit()), data_path)


def _ran_to_its_end(sweep: SweepConfig, results: ResultGrid) -> ResultGrid:
    """``results``, of a sweep that ended. On Ctrl-C Tune saves the sweep's state and returns as if it had ended,
    having stopped the trials still running: summarized, the sweep would count as finished, and neither the same
    command nor ``--resume`` would resume it. The state Tune saved last, before it stopped them, tells: a trial
    still running then, or, interrupted between two trials, fewer trials than the sweep has with its budget and
    target not reached."""
    saved = ExperimentAnalysis(results.experiment_path, storage_filesystem=results.filesystem).trials
    all_ended = all(trial.status in (Trial.TERMINATED, Trial.ERROR) for trial in saved)
    if not all_ended or (len(saved) < sweep.num_trials and not SweepBudget(sweep).count_restored(saved).stop_all()):
        path = sweep_dir(sweep)
        raise KeyboardInterrupt(
            f"sweep {sweep.name!r} saved its state in {path}: run it again with the same settings (or "
            f"{resume_command(path)}) to resume it"
        )
    return results


def _summary_from_files(sweep: SweepConfig, path: str) -> SweepResult:
    """The summary of the finished sweep at ``path`` again, from its files: no Ray to start."""
    cfg = sweep.base_config([f"run.storage_path={storage.absolute(sweep.storage_root())}"])
    results = ResultGrid(ExperimentAnalysis(storage.absolute(path)))
    return summarize(sweep, results, storage.absolute(dataset_path(cfg)))


def _ran_with(sweep: SweepConfig, path: str) -> bool:
    """Whether the sweep at ``path`` was started with the settings of ``sweep``."""
    written = storage.read_if_exists(storage.join(path, SWEEP_FILE))
    return written is not None and yaml.safe_load(written) == sweep.to_dict()


def _nothing_to_resume(path: str) -> bool:
    """Whether the sweep at ``path`` finished with no trial failed (``--resume`` runs failed trials again)."""
    summary = storage.read_if_exists(storage.join(path, TRIALS_FILE))
    return summary is not None and not pd.read_csv(io.BytesIO(summary))["error"].any()


def summarize(sweep: SweepConfig, results, data_path: str) -> SweepResult:
    """The trials table, the best recipe and the plots of a finished sweep."""
    max_steps, path = sweep.base_config().optim.max_steps, sweep_dir(sweep)
    rows, curves, failed = [], {}, []
    for result in results:
        history = result.metrics_dataframe
        reported = history is not None and sweep.metric in history
        # Proposed, or started, but the sweep ended (step_budget, target) before the trial reported: it trained
        # nothing that counts. Left out alike from the sweep's own summary and from one made from its files later,
        # where Tune's files give a started trial that never reported no config.
        if result.config is None or not (reported or result.error):
            continue
        row = {
            # A trial that failed before its first report has no metrics: its id is in its directory name.
            "trial_id": result.metrics.get("trial_id") or os.path.basename(result.path).split("_")[2],
            **{key: result.config[key] for key in sweep.space},
            "val_loss": float(history[sweep.metric].iloc[-1]) if reported else float("nan"),
            "steps": int(history["step"].iloc[-1]) if reported else 0,
            "stopped_early": reported and int(history["step"].iloc[-1]) < max_steps,
            "error": result.error is not None,
            "started": float(history["trial_start"].min()) if reported else float("nan"),
            "ended": float(history["time"].max()) if reported else float("nan"),
            "node_id": result.metrics.get("node_id"),
        }
        if reported:
            curves[row["trial_id"]] = history[["step", sweep.metric, "time"]].drop_duplicates("step", keep="last")
        if result.error is not None:
            error_file = storage.join(path, os.path.basename(result.path), "error.txt")
            failed.append(FailedTrial(row["trial_id"], str(result.error).strip().splitlines()[-1], error_file))
        rows.append(row)
    if not curves:
        nothing = f"sweep {sweep.name!r}: no trial reported {sweep.metric}"
        if not failed:
            raise SweepFailed(f"{nothing}; see the logs in {path}")
        first = failed[0]
        raise SweepFailed(
            f"{nothing}; trial {first.trial_id} failed: {first.error} (its traceback: {first.error_file}); "
            f"to run the trials again: {resume_command(path)}"
        )
    trials = pd.DataFrame(rows).sort_values("started").reset_index(drop=True)
    best = _best(trials, list(sweep.space))
    storage.write_bytes(storage.join(path, TRIALS_FILE), trials.to_csv(index=False).encode())
    recipe = write_best_recipe(sweep, best, data_path)
    plots = save_plots(sweep, trials, curves, path)
    return SweepResult(path, trials, best, recipe, plots, curves, failed)


def _best(trials: pd.DataFrame, space_keys: list[str]) -> BestTrial:
    """The trial of lowest ``val_loss`` among those that trained to the last step; where none did (the step
    budget or the target ended the sweep first), among those that did not fail; where all failed, among all."""
    reported = trials[trials["val_loss"].notna()]
    finished = reported[~reported["stopped_early"] & ~reported["error"]]
    not_failed = reported[~reported["error"]]
    candidates = next(c for c in (finished, not_failed, reported) if len(c))
    return BestTrial.of_row(candidates.sort_values("val_loss").iloc[0], space_keys)


def check_best_recipe_path(sweep: SweepConfig) -> None:
    """``best_recipe_path`` can take the best recipe when the sweep ends: a new file, or one a sweep wrote, where
    it can be written. Checked before any trial runs: a directory or the user's own file there would otherwise fail
    the sweep at its end, or be overwritten."""
    path = sweep.best_recipe_path
    if not path:
        return
    check_storage(posixpath.dirname(storage.absolute(path)), "best_recipe_path")  # reachable, or writable here
    fs, where = storage.resolve(path)
    kind = fs.get_file_info(where).type
    if kind == pafs.FileType.Directory:
        raise ConfigError(f"best_recipe_path: {path} is a directory; give the path of a YAML file")
    if kind == pafs.FileType.File and not storage.read_bytes(path).startswith(BEST_RECIPE_HEADER.encode()):
        raise ConfigError(
            f"best_recipe_path: {path} is a file that no sweep wrote; give another path (a sweep overwrites only "
            "its own best recipes)"
        )


def write_best_recipe(sweep: SweepConfig, best: BestTrial, data_path: str) -> str:
    """best-<sweep>.yaml in the sweep directory (and at ``best_recipe_path`` if set): the base recipe with
    the best parameters, complete and ready to train. The path to train it from."""
    cfg = trial_config(sweep, best.params, f"best-{sweep.name}", data_path)
    cfg.run.storage_path = sweep.storage_root()
    targets = [storage.join(sweep_dir(sweep), f"best-{sweep.name}.yaml")]
    if sweep.best_recipe_path:
        targets.insert(0, storage.absolute(sweep.best_recipe_path))
    header = (
        f"{BEST_RECIPE_HEADER}{sweep.name!r}: trial {best.trial_id}, {sweep.metric} {best.val_loss:.4f} "
        f"after {best.steps} steps.\n# Train it: python -m train --config {targets[0]}\n"
    )
    text = header + yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    for target in targets:
        storage.write_bytes(target, text.encode())
    return targets[0]

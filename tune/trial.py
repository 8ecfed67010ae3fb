"""One sweep trial: the real training loop of ``train/`` with the trial's parameters.

A one-worker trial runs the loop in its own process as a one-rank DeepSpeed job (a one-rank
gloo/NCCL group, no Ray Train start-up, which costs ~40 s per trial here). A trial of more workers
runs a Ray Train DeepSpeed job from its process (Train inside Tune). Either way the trial's run
directory is named by the trial id, so a trial restarted after its node was lost or pre-empted, or
after the sweep was restored, resumes from its last checkpoint instead of starting over (and one that had
ended, finished or stopped by ASHA, reports the evaluation it ended with again). A one-worker
trial whose node Ray drains for a pre-emption (a spot notice) checkpoints as a training run's workers do:
at once, and again shortly before the deadline.
"""

import logging
import math
import time
from typing import Any

import ray
from ray import tune
from ray.train import PreemptionInfo
from ray.tune.integration.ray_train import TuneReportCallback

from train import storage
from train.evaluation import Evaluation
from train.export import final_evaluation
from train.launch import build_trainer, loop_args, run_uri
from train.loop import train_loop
from train.loop_args import SharedFolder
from train.manifest import Manifest
from train.process_group import one_process_group
from train.schema import read_record
from train.stops import DivergedError, stop_in
from tune.config import SweepConfig, override

logger = logging.getLogger(__name__)


def trial_config(sweep: SweepConfig, params: dict[str, Any], trial_id: str, data_path: str):
    return sweep.base_config(
        [
            *(override(key, value) for key, value in params.items()),
            # Quoted: a trial id of digits only would otherwise be read as a number.
            override("run.name", trial_id),
            override("run.storage_path", trials_dir(sweep)),
            override("data.path", data_path),
            # With Train workers, trial_resources are each worker's (CPU included: it wins over cpus_per_worker).
            *([override("scaling.resources_per_worker", sweep.trial_resources)] if sweep.on_ray_train else []),
        ]
    )


def sweep_dir(sweep: SweepConfig) -> str:
    return storage.absolute(storage.join(sweep.storage_root(), "sweeps", sweep.name))


def trials_dir(sweep: SweepConfig) -> str:
    """Where the trials' training runs are, each named by its trial id."""
    return storage.join(sweep_dir(sweep), "trials")


# In a trial's run directory: the evaluation the trial ended with, written when Tune ends it for good.
ENDED = "ended.json"


def record_ended(run: str, last_result: dict) -> None:
    """Note in a trial's run directory ``run`` that it ended for good (finished, or stopped by ASHA) with
    ``last_result``."""
    evaluation = Evaluation.in_report(last_result)
    if evaluation:
        storage.write_json(storage.join(run, ENDED), evaluation.model_dump())


def ended_evaluation(run: str) -> Evaluation | None:
    """The evaluation that the trial of run directory ``run`` ended with, or None if it has not ended."""
    return final_evaluation(run) or read_record(Evaluation, storage.join(run, ENDED), "an ended trial's record")


def _trial_evaluation(report: dict) -> Evaluation | None:
    """What Tune sees of a training report: its evaluation only, as ASHA compares trials on the validation loss
    at equal steps. A trial whose training diverged ends as the worst result (reported as NaN, ASHA would never
    stop it, as NaN < cutoff is false, and Optuna would drop it as failed, learning nothing from it). One that
    stopped for another reason (a full disk: no fault of its parameters) fails, raising it."""
    stopped = stop_in(report)
    if isinstance(stopped, DivergedError):
        worst = math.inf
        return Evaluation(step=report["step"], val_loss=worst, val_perplexity=worst, val_bpb=worst, time=report["time"])
    if stopped:
        raise stopped
    return Evaluation.in_report(report)


def _to_tune(evaluation: Evaluation, start: float, node_id: str) -> dict:
    """An evaluation as the trial reports it to Tune: with when the trial started and the node it runs on."""
    return {**evaluation.model_dump(), "trial_start": start, "node_id": node_id}


class _EvaluationsToTune(TuneReportCallback):
    """Ray Train's reports to Tune, evaluations only (rank 0's: every rank reports the same figures)."""

    def __init__(self, start: float, node_id: str):
        super().__init__()
        self.start, self.node_id = start, node_id

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        evaluation = _trial_evaluation(metrics[0])
        if evaluation:  # checkpoints are raywright's own
            super().after_report(run_context, [_to_tune(evaluation, self.start, self.node_id)], None)


def this_nodes_preemption() -> PreemptionInfo | None:
    """The pre-emption notice of the node this process runs on, read as Ray Train's watcher reads it for its
    workers (which a one-process trial does not have): whether Ray drains the node, and by when. A GCS that
    does not answer is no notice (logged; asked again at the next check), as for Ray Train's watcher."""
    node = ray.get_runtime_context().get_node_id()
    try:
        deadline_ms = ray._private.state.state.get_draining_nodes().get(node)
    except Exception:
        logger.warning("could not read this node's drain state from Ray", exc_info=True)
        return None
    if deadline_ms is None:
        return None
    return PreemptionInfo(deadline_ms=deadline_ms or None, preempted_node_to_ranks={node: [0]})  # 0: no deadline


def run_trial(
    params: dict[str, Any],
    sweep: SweepConfig,
    data_path: str,
    manifest: Manifest,
    shared_folder: SharedFolder | None = None,
) -> None:
    """The Tune trainable (bound with ``tune.with_parameters``); its training workers check that they see
    ``shared_folder`` (``train/loop.py``)."""
    cfg = trial_config(sweep, params, tune.get_context().get_trial_id(), data_path)
    node_id = ray.get_runtime_context().get_node_id()
    start = time.time()
    ended = ended_evaluation(run_uri(cfg))
    if ended is not None:
        # It ended after Tune last saved the sweep's state (every ~10 s) and the sweep was interrupted before
        # the next save. Resumed as unfinished, it reports the evaluation it ended with rather than train again
        # from scratch (its checkpoints went when it ended), steps the sweep's step budget would count only in part.
        tune.report(_to_tune(ended, start, node_id))
        return
    if sweep.on_ray_train:
        callbacks = [_EvaluationsToTune(start, node_id)]
        build_trainer(cfg, data_path, manifest, callbacks=callbacks, shared_folder=shared_folder).fit()
        return

    def report(metrics: dict) -> None:
        evaluation = _trial_evaluation(metrics)
        if evaluation:
            tune.report(_to_tune(evaluation, start, node_id))

    with one_process_group(cfg.scaling.use_gpu):
        args = loop_args(cfg, data_path, manifest, shared_folder=shared_folder)
        train_loop(args.to_dict(), report=report, preemption_info=this_nodes_preemption)

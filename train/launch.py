"""Driver side of a training run: Ray, the dataset, the TorchTrainer, and the run summary."""

import contextlib
import math
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import ray
from ray._private.ray_constants import DEFAULT_DASHBOARD_PORT
from ray.actor import ActorHandle
from ray.train import FailureConfig
from ray.train import RunConfig as RayRunConfig
from ray.train import ScalingConfig as RayScalingConfig
from ray.train.torch import TorchConfig
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from train import checkpoint, storage
from train.cli import take_sigterm_as_ctrl_c, use_cpu_deepspeed_unless_gpu_workers
from train.config import TrainConfig
from train.data import prepare
from train.evaluation import Evaluation
from train.export import final_evaluation
from train.lease import LEASE, Lease
from train.loop import train_loop
from train.loop_args import LoopArgs, SharedFolder
from train.manifest import Manifest, load_manifest
from train.metrics import HEALTH_CHECK_INTERVAL_ENV, MetricsRecorder, read_metrics
from train.preflight import check_dataset_matches, cluster_address
from train.process_group import free_port, own_state_api_env
from train.provenance import Provenance
from train.run_layout import export_uri
from train.scaling_policy import ElasticTorchTrainer
from train.schema import replace
from train.shared_storage import check_nodes_share, dataset_setting, shared_folder
from train.timeline import (
    TIMELINE_PREFIX,
    ElasticSummary,
    RunTimeline,
    read_saved_state,
    read_summary,
    summarize,
    write_summary,
)

# One progress line per report in the terminal, without Ray Train's echo of every report.
RAY_TRAIN_LOGGING_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0"}

# glibc malloc, fixed for a training step. Its default mmap threshold drifts as blocks are freed, and
# a heap gives memory back to the OS past 128 KiB free, so a worker's training thread faulted in fresh
# pages for each step's activations: 0.2-2k page faults a step on the CPU, at 2.5 us each (P1 in
# BENCHMARKS.md). With fixed thresholds a step reuses what the last one freed. Other allocators ignore these.
TRAIN_WORKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
# The workers of a run on CPUs, wherever Ray places them. DeepSpeed takes its device as it loads: this variable's,
# else any GPU it sees. Ray 2.60 no longer hides a node's GPUs from workers that reserved none, so on a GPU node
# a CPU run's worker would take a GPU that it had not reserved, beside the run that had; on a CPU node each warned
# that it found no GPU. A driver's environment reaches the workers of a Ray it starts, not those of a cluster.
CPU_WORKER_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}


@dataclass
class RunSummary:
    run_dir: str
    checkpoint: str | None
    export: str
    initial_val_loss: float | None
    final_val_loss: float | None
    final_val_bpb: float | None  # bits per byte, which compares across tokenizers
    steps: int
    elastic: ElasticSummary | None  # None: the run's drivers left no record of its attempts (train/timeline.py)


def code_version() -> str:
    """The git commit of this checkout (with ``-dirty`` if modified), else the package version."""
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        return f"git:{rev}"
    except (OSError, subprocess.CalledProcessError):
        try:
            return f"raywright {metadata.version('raywright')}"
        except metadata.PackageNotFoundError:
            return "unknown"


def init_ray(cfg: TrainConfig, min_cpus: float = 0.0) -> bool:
    """Connect to ``run.ray_address``, or to the cluster of a Ray job (RAY_ADDRESS), else start a private Ray of
    at least the run's workers' CPUs and ``min_cpus``, however many cores this machine has.

    True when it started a private Ray: one that no autoscaler grows, so what it lacks never comes.
    """
    if ray.is_initialized():
        return False
    use_cpu_deepspeed_unless_gpu_workers(cfg)
    address = cluster_address(cfg)
    if address:
        ray.init(address=address)
        return False
    # A private embedded Ray, never one that happens to run on this machine.
    num_cpus = max(os.cpu_count() or 1, cfg.scaling.max_workers * cfg.scaling.cpus_per_worker, math.ceil(min_cpus))
    # Its dashboard's port is known before it starts, so that its processes and this driver ask its state API.
    dashboard_port = free_port(prefer=DEFAULT_DASHBOARD_PORT)  # the port a user knows, where it is free
    os.environ.update(own_state_api_env(dashboard_port))
    ray.init(address="local", num_cpus=num_cpus, dashboard_port=dashboard_port)
    return True


def resources_offered(resources: dict[str, float], setting: str) -> dict[str, float]:
    """``resources`` less those that no node of this (private) Ray has, each dropped with one warning line.

    A task asking for them would wait forever; on a cluster, call it not: an autoscaler may add such nodes.
    """
    available = ray.cluster_resources()
    missing = [name for name in resources if name not in available]
    for name in missing:
        print(
            f"warning: {setting}: no node of this local Ray offers {name!r} and none can be added; "
            f"running without it (set {setting} to drop it)",
            file=sys.stderr,
            flush=True,
        )
    return {name: amount for name, amount in resources.items() if name not in missing}


def say_what_the_cluster_lacks(cfg: TrainConfig) -> None:
    """On a cluster, one line naming the resources that no node offers yet: the run waits for an autoscaler."""
    per_worker = {"CPU": cfg.scaling.cpus_per_worker, **cfg.scaling.resources_per_worker}
    if cfg.scaling.use_gpu:
        per_worker["GPU"] = 1
    available = ray.cluster_resources()
    lacking = {name: amount for name, amount in per_worker.items() if available.get(name, 0) < amount}
    if lacking:
        print(
            f"waiting for the cluster to add nodes offering {lacking} per worker "
            f"(scaling.use_gpu, scaling.cpus_per_worker, scaling.resources_per_worker); an autoscaler adds them "
            "if its node types have them",
            file=sys.stderr,
            flush=True,
        )


def set_ray_train_env(cfg: TrainConfig) -> None:
    """Ray Train reads these from the driver's environment and passes them to its controller and workers.

    Its defaults (2 s health checks, 60 s worker-group start timeout) made every report take over
    a second and recovery from a lost node take ~90 s; the config's values keep both short. Each is a
    default: a value already in the environment wins.
    """
    defaults = {
        **RAY_TRAIN_LOGGING_ENV,
        HEALTH_CHECK_INTERVAL_ENV: str(cfg.scaling.health_check_interval_s),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(cfg.scaling.worker_start_timeout_s),
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def train_worker_env(cfg: TrainConfig) -> dict[str, str]:
    """The environment variables raywright sets in the training workers of ``cfg``: malloc's, where the driver's
    environment has none, and a CPU run's (``CPU_WORKER_ENV``)."""
    env = {name: os.environ.get(name, value) for name, value in TRAIN_WORKER_MALLOC_ENV.items()}
    if not cfg.scaling.use_gpu:
        env.update(CPU_WORKER_ENV)
    return env


def run_uri(cfg: TrainConfig) -> str:
    """The run's directory (local, absolute) or URI: its checkpoints, export, metrics and lease."""
    return storage.absolute(storage.join(cfg.run.storage_path, cfg.run.name))


def loop_args(
    cfg: TrainConfig,
    data_path: str,
    manifest: Manifest,
    timeline: str | None = None,
    shared_folder: SharedFolder | None = None,
) -> LoopArgs:
    """The ``args`` of ``train_loop`` for ``cfg``; ``timeline`` names the RunTimeline actor to report to, and the
    workers check that they see ``shared_folder``."""
    return LoopArgs(
        config=cfg,
        run_uri=run_uri(cfg),
        data_path=storage.absolute(data_path),
        timeline=timeline,
        tokens_per_byte=manifest.tokens_per_byte,
        provenance=Provenance(
            data_manifest_sha256=manifest.sha256, data_source_sha256=manifest.source_sha256, code_version=code_version()
        ),
        shared_folder=shared_folder,
    )


def build_trainer(
    cfg: TrainConfig,
    data_path: str,
    manifest: Manifest,
    timeline: str | None = None,
    callbacks: list = (),
    shared_folder: SharedFolder | None = None,
) -> ElasticTorchTrainer:
    """The TorchTrainer for ``cfg``; ``callbacks`` are added to raywright's metrics recorder; the other arguments
    are ``loop_args``'."""
    set_ray_train_env(cfg)
    scaling = cfg.scaling
    num_workers = scaling.num_workers if isinstance(scaling.num_workers, int) else tuple(scaling.num_workers)
    return ElasticTorchTrainer(
        train_loop,
        train_loop_config=loop_args(cfg, data_path, manifest, timeline, shared_folder).to_dict(),
        scaling_config=RayScalingConfig(
            num_workers=num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker={"CPU": scaling.cpus_per_worker, **scaling.resources_per_worker},
            elastic_resize_monitor_interval_s=scaling.resize_check_interval_s,
        ),
        run_config=RayRunConfig(
            name=cfg.run.name,
            storage_path=storage.absolute(cfg.run.storage_path),
            # Pre-emptions are routine on spot nodes: unlimited; real failures are bounded.
            failure_config=FailureConfig(max_failures=scaling.max_failures, max_preemption_failures=-1),
            callbacks=[MetricsRecorder(run_uri(cfg), cfg.optim.max_steps, cfg.run.side_files_upload_s), *callbacks],
            worker_runtime_env={"env_vars": train_worker_env(cfg)},  # read at a worker process's start
        ),
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
    )


def ensure_dataset(cfg: TrainConfig, storage_key: str = "run.storage_path") -> tuple[str, Manifest]:
    """The prepared dataset's path and manifest, preparing it first if it is missing or incomplete.

    ``storage_key``: the setting that names ``cfg.run.storage_path`` (a sweep's is its own).
    """
    data = cfg.data
    setting, path = dataset_setting(cfg, storage_key)
    manifest = load_manifest(path)
    if manifest is None:
        print(f"preparing dataset from {data.source or 'the Python standard library'} into {path}", flush=True)
        manifest = prepare(data, path, cfg.model.seq_len, setting)
        print(f"{manifest.tokens_per_byte:.3f} tokens per byte with the {data.tokenizer} tokenizer", flush=True)
    else:
        check_dataset_matches(cfg, path, manifest)
    return path, manifest


def run_training(cfg: TrainConfig, stop_on_sigterm: bool = False) -> RunSummary:
    """Train ``cfg`` to completion (resuming the run of the same name if it exists), holding its lease;
    raises ``RunStopped`` (train/stops.py) where training diverged or a disk filled up.

    ``stop_on_sigterm``: the command line's run, where ``ray job stop`` should abort gracefully.
    """
    with Lease(run_uri(cfg), cfg.run.lease_stale_after_s):
        return _train_holding_lease(cfg, stop_on_sigterm)


def _train_holding_lease(cfg: TrainConfig, stop_on_sigterm: bool) -> RunSummary:
    trained = _already_trained(cfg)
    if trained is not None:
        print(
            f"run {cfg.run.name!r} is already trained to step {trained.steps} and exported; nothing to train "
            f"(optim.max_steps is {cfg.optim.max_steps}: raise it to train on, or give a new run.name)",
            flush=True,
        )
        return trained
    if init_ray(cfg):
        offered = resources_offered(cfg.scaling.resources_per_worker, "scaling.resources_per_worker")
        cfg = replace(cfg, scaling=replace(cfg.scaling, resources_per_worker=offered))
    else:
        say_what_the_cluster_lacks(cfg)
        check_nodes_share([("run.storage_path", cfg.run.storage_path), dataset_setting(cfg)])
    if stop_on_sigterm:  # Ray Train's graceful abort withdraws the run's autoscaler request: its nodes go back
        take_sigterm_as_ctrl_c()  # after the idle timeout, not 3 minutes later when the request expires
    data_path, manifest = ensure_dataset(cfg)
    run = run_uri(cfg)
    # The workers look for the lease that this driver holds in the run's folder.
    shared_run_folder = shared_folder("run.storage_path", cfg.run.storage_path, storage.join(run, LEASE))
    timeline_name = f"{TIMELINE_PREFIX}{cfg.run.name}-{uuid.uuid4().hex[:8]}"
    # On the driver's node (the head on a cluster): the timeline must outlive any worker node.
    timeline = RunTimeline.options(
        name=timeline_name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    ).remote(
        cfg.cost.price_per_hour,
        cfg.cost.on_demand_type,
        run,
        read_saved_state(run),  # an earlier driver's, continued
        cfg.run.side_files_upload_s,
    )
    try:
        build_trainer(cfg, data_path, manifest, timeline_name, shared_folder=shared_run_folder).fit()
    except BaseException:
        # Stopped (Ctrl-C, `ray job stop`) or failed: this driver's part of the run ends here, and is not lost:
        # a driver that resumes the run adds a segment to its record, the time between not counted.
        with contextlib.suppress(Exception):  # a Ray going down with it: the error in flight is the one to see
            ray.get(timeline.finished.remote(), timeout=10)
        raise
    return record_trained_run(cfg, timeline)


def record_trained_run(cfg: TrainConfig, timeline: ActorHandle) -> RunSummary:
    """The driver's end of a run its workers trained and exported: the run's record saved, its summary read.

    Storage that cannot be reached at this moment is waited for (``run.storage_wait_s``), as a restarting worker
    waits: the run is done, and an outage now must not fail the command or leave its record unsaved.
    """
    run = run_uri(cfg)
    storage.wait_until_reachable([run], cfg.run.storage_wait_s)
    ray.get(timeline.finished.remote())
    elastic = ray.get(timeline.summary.remote())
    stopped = ray.get(timeline.stop.remote())
    ray.kill(timeline)
    if elastic:
        write_summary(run, elastic)
    if stopped:
        raise stopped
    return _summary(run, checkpoint.latest_complete(run), read_metrics(run), elastic)


def _already_trained(cfg: TrainConfig) -> RunSummary | None:
    """The summary of a run whose newest checkpoint is at or past ``optim.max_steps`` and whose export is of that
    step, as its last training left it (its elastic record included, which a run that trained nothing would
    overwrite); None where something is left to do. A run that stopped between its last checkpoint and its
    export is not finished: its workers restore that checkpoint, evaluate and export it."""
    run = run_uri(cfg)
    latest = checkpoint.latest_complete(run)
    if latest is None or latest.step < cfg.optim.max_steps:
        return None
    evaluation = final_evaluation(run)
    if evaluation is None or evaluation.step != latest.step:
        return None
    elastic = read_summary(run)
    if elastic is None:  # its driver stopped before it wrote the record: made again from the events it saved
        saved = read_saved_state(run)
        elastic = saved and summarize(saved, cfg.cost.price_per_hour, cfg.cost.on_demand_type)
    return _summary(run, latest, read_metrics(run), elastic)


def _summary(
    run: str, latest: checkpoint.Checkpoint | None, reports: list[dict], elastic: ElasticSummary | None
) -> RunSummary:
    evaluations = [evaluation for evaluation in map(Evaluation.in_report, reports) if evaluation]
    return RunSummary(
        run_dir=run,
        checkpoint=latest.uri if latest else None,
        export=export_uri(run),
        initial_val_loss=evaluations[0].val_loss if evaluations else None,
        final_val_loss=evaluations[-1].val_loss if evaluations else None,
        final_val_bpb=evaluations[-1].val_bpb if evaluations else None,
        steps=latest.step if latest else 0,
        elastic=elastic,
    )

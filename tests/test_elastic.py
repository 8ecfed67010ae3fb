"""Elastic DeepSpeed on a simulated cluster: a head plus three one-worker nodes.

One run per ZeRO stage walks through the three scenarios in turn, each while training:
(a) a node is lost -> the run continues at 2 workers; (b) the node comes back -> it grows to
3; (c) a node is drained with a deadline (spot pre-emption) -> a just-in-time checkpoint is
taken and the run resumes from it at 2 workers. The loss curve must equal an uninterrupted
fixed-size run's, and the sample log must show every sample of the epoch exactly once.

The two stages share that fixed-size run (ZeRO-2): uninterrupted ZeRO-2 and ZeRO-3 runs of this test differ
by less than 5e-7 in any step's loss, far below what it allows (1e-4).
"""

import json
import os
import shutil
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
from ray._common.test_utils import wait_for_condition

from cluster.drain import drain_node
from train.config import DataConfig, load_config
from train.data import prepare
from train.launch import run_training, run_uri
from train.loader import SampleOrder
from train.manifest import load_manifest
from train.timeline import Progress, progress_of

pytestmark = pytest.mark.cluster

SLOT = "elastic_test_slot"  # only the added nodes offer it, so no training worker lands on the head
GLOBAL_BATCH = 12  # divides for 2 and 3 workers with micro batch 2


@pytest.fixture(scope="module")
def elastic_dataset(ray_session, tmp_path_factory) -> str:
    """~1,500 training sequences: one epoch is ~125 steps of 12. The pre-emption notice comes at step 25-45 (the
    grow before it waits for a node to start, however fast the steps), and the run must outlast its 6 s deadline:
    ~55 steps of ZeRO-2 at 3 workers where a step takes 0.13 s (a 64-step epoch ended first there)."""
    corpus = tmp_path_factory.mktemp("elastic-corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "wsgiref", "html"):  # wsgiref/headers.py hashes into validation
        shutil.copytree(stdlib / package, corpus / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = str(tmp_path_factory.mktemp("elastic-data") / "ds")
    prepare(DataConfig(source=f"{corpus}/**/*.py", val_fraction=0.1), out, load_config("tiny").model.seq_len)
    return out


@pytest.fixture(scope="module")
def node_disks(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("node-disks")


@pytest.fixture(scope="module")
def worker_nodes(ray_cluster, node_disks):
    nodes = [_add_node(ray_cluster, node_disks) for _ in range(3)]
    yield nodes
    for node in nodes:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node, allow_graceful=False)


def _add_node(cluster, disks: Path, disk: str | None = None):
    """A node whose $TMPDIR is ``disk`` (a new folder of ``disks`` by default), as a cloud node has a disk of its
    own: it starts without node-local copies."""
    disk = disk or tempfile.mkdtemp(dir=disks)
    return cluster.add_node(num_cpus=1, resources={SLOT: 1, "spot": 1}, env_vars={"TMPDIR": disk})


def _data_copied_at(disk: str) -> float:
    """When a node finished its copy of the training split (train/data.py), from the file's mtime."""
    (copy,) = Path(disk).glob("raywright-data/*/train.u16")
    return copy.stat().st_mtime


def _wait_for(run_name: str, attempts: int, world_size: int, min_step: int, thread, timeout: float = 240) -> Progress:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert thread.is_alive(), "the run ended before the scenario was played"
        progress = progress_of(run_name)
        if progress.attempts == attempts and progress.world_size == world_size and progress.step >= min_step:
            return progress
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for attempt {attempts} at {world_size} workers: {progress}")


def _config(dataset: str, storage: str, name: str, stage: int, num_workers: str, max_steps: int):
    return load_config(
        "tiny",
        [
            f"data.path={dataset}",
            f"run.storage_path={storage}",
            f"run.name={name}",
            f"deepspeed.zero_stage={stage}",
            f"scaling.num_workers={num_workers}",
            f"scaling.resources_per_worker={{{SLOT}: 1}}",
            "scaling.resize_check_interval_s=2",
            "scaling.worker_start_timeout_s=15",
            f"optim.global_batch_size={GLOBAL_BATCH}",
            "optim.micro_batch_size=2",
            # Below the recipe's 3e-3, at which this batch of 12 spikes the loss (3.0 -> 4.6 at step 14): the spike
            # grew the fp32 difference between a 3- and a 2-worker gradient sum to 1e-3 between two uninterrupted
            # ZeRO-3 runs, hiding what this test measures (the restores). At 2e-3 they differ by 1e-6.
            "optim.lr=2e-3",
            f"optim.max_steps={max_steps}",
            "checkpoint.every_steps=10",
            "checkpoint.keep_last=10",
            "run.log_every=5",  # reports more often than Ray Train takes them (0.5 s) would slow every step
            f"run.eval_every={max_steps}",
            "run.eval_samples=36",
            "run.sample_log=true",
            "cost.price_per_hour={spot: 1.0, ondemand: 3.0}",
            "checkpoint.preemption_check_s=0.5",  # in proportion to the 6 s deadline (EC2 gives 120 s)
        ],
    )


def _step_log(cfg) -> dict[int, dict]:
    """The sample log by step; a redone step's last execution is the one that counts."""
    with open(os.path.join(run_uri(cfg), "samples.jsonl")) as f:
        return {record["step"]: record for record in map(json.loads, f)}


def _epoch_steps(dataset: str) -> int:
    """One full epoch, and a step into the next (straddling the two, or not)."""
    return load_manifest(dataset).train.sequences // GLOBAL_BATCH + 1


@pytest.fixture(scope="module")
def fixed_size_log(worker_nodes, elastic_dataset, tmp_path_factory) -> dict[int, dict]:
    """The sample log of an uninterrupted run at 2 workers, ZeRO-2."""
    storage = str(tmp_path_factory.mktemp("fixed-size"))
    baseline = _config(elastic_dataset, storage, "fixed", 2, "2", _epoch_steps(elastic_dataset))
    run_training(baseline)
    return _step_log(baseline)


@pytest.mark.parametrize("stage", [2, 3])
def test_shrink_grow_and_preemption_keep_the_numbers_exact(
    stage, ray_cluster, worker_nodes, node_disks, elastic_dataset, fixed_size_log, tmp_path
):
    rows = load_manifest(elastic_dataset).train.sequences
    max_steps = _epoch_steps(elastic_dataset)
    cfg = _config(elastic_dataset, str(tmp_path), f"elastic{stage}", stage, "[2,3]", max_steps)
    # The run starts at 3 workers: the node the stage before added in place of its pre-empted one must be up, and
    # the pre-empted one gone, in the resources Ray's policy sizes the run from.
    wait_for_condition(lambda: ray.available_resources().get(SLOT, 0) == 3, timeout=60)
    result = []
    thread = threading.Thread(target=lambda: result.append(run_training(cfg)))
    thread.start()

    at = _wait_for(cfg.run.name, attempts=1, world_size=3, min_step=12, thread=thread)
    lost = worker_nodes[2]
    ray_cluster.remove_node(lost, allow_graceful=False)  # (a) a node dies without notice
    at = _wait_for(cfg.run.name, attempts=2, world_size=2, min_step=at.step + 2, thread=thread)
    returned_disk = tempfile.mkdtemp(dir=node_disks)
    worker_nodes[2] = _add_node(ray_cluster, node_disks, returned_disk)  # (b) capacity returns
    at = _wait_for(cfg.run.name, attempts=3, world_size=3, min_step=at.step + 2, thread=thread)
    preempted = worker_nodes[1]
    drain_node(preempted.node_id, deadline_s=6)  # (c) a spot pre-emption notice with a deadline
    _wait_for(cfg.run.name, attempts=4, world_size=2, min_step=0, thread=thread)
    thread.join(timeout=300)
    assert result, "the elastic run did not finish"
    if preempted in ray_cluster.worker_nodes:
        ray_cluster.remove_node(preempted, allow_graceful=False)
    worker_nodes[1] = _add_node(ray_cluster, node_disks)
    summary = result[0]
    elastic = summary.elastic

    resizes = [(r.from_workers, r.to_workers, r.reason) for r in elastic.resizes]
    assert resizes == [(3, 2, "node lost"), (2, 3, "capacity returned"), (3, 2, "preemption")]
    jit = [c.step for c in elastic.checkpoints if c.reason == "preemption"]
    last = [c.step for c in elastic.checkpoints if c.reason == "deadline"]
    # A just-in-time checkpoint at the notice, a last one shortly before the deadline, at which the run waits
    # for Ray Train's restart: the steps trained while the node drained are not lost, and none is redone.
    assert len(jit) == 1 and len(last) == 1 and last[0] > jit[0]
    # Growing back waits for the checkpoint it asked for, at which the run waits for the restart: no step is
    # redone, where Ray alone restarts from the last periodic checkpoint (up to checkpoint.every_steps - 1 redone).
    assert elastic.resizes[1].steps_redone == 0, elastic.resizes[1]
    # The returned node copied the data while the run trained on, before that checkpoint: no worker waited for it.
    grow_checkpoint = next(c for c in elastic.checkpoints if c.step == elastic.resizes[1].at_step)
    assert _data_copied_at(returned_disk) < grow_checkpoint.time
    assert elastic.resizes[2].at_step == last[0] and elastic.resizes[2].steps_redone == 0
    assert all(r.seconds_lost > 0 for r in elastic.resizes)
    assert 0 < elastic.goodput < 1 and elastic.cost < elastic.cost_on_demand_only
    assert summary.steps == max_steps and summary.final_val_loss < summary.initial_val_loss

    # Every step trained exactly the samples it owns: each sample of the epoch exactly once.
    log = _step_log(cfg)
    assert sorted(log) == list(range(1, max_steps + 1))
    assert {r["world_size"] for r in log.values()} == {2, 3}
    order = SampleOrder(rows, cfg.run.seed)
    for step, record in log.items():
        expected = order.rows(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH))
        assert sorted(record["rows"]) == sorted(expected.tolist())
    whole_steps = rows // GLOBAL_BATCH  # the step after these holds epoch 0's last samples, if any
    epoch = [row for step in range(1, whole_steps + 1) for row in log[step]["rows"]]
    assert len(epoch) == len(set(epoch))  # nothing repeated
    assert set(epoch) | set(log[whole_steps + 1]["rows"]) == set(range(rows))  # nothing lost

    # The same math as an uninterrupted run at a fixed size.
    assert sorted(fixed_size_log) == sorted(log)
    worst = max(abs(log[s]["loss"] - fixed_size_log[s]["loss"]) for s in log)
    assert worst < 1e-4, f"loss curves differ by up to {worst}"

"""P4 recovery seconds and P4g goodput of elastic runs on a simulated cluster.

    python bench/elastic.py recovery [--notice-s 20] [--zero-stage 2] [--max-steps 400] [--data-gb 0]
    python bench/elastic.py goodput [--minutes 30] [--preempt-every-min 10] [--notice-s 120] [--return-after-s 60]

A head plus three one-worker spot nodes run the tiny recipe elastically between 2 and 3 workers. Each
node has a $TMPDIR of its own, as a cloud node has its own disk, so a node that joins copies the data
(train/data.py). ``--data-gb G`` trains on G GB of random tokens instead of the recipe's corpus (~40 MB),
to time what that copy costs a grow.

``recovery`` plays the three events of a spot cluster once each: a node killed without notice (P4:
seconds from the kill to the first finished step after the resume), a replacement node joining (the
run grows back, from a checkpoint taken for it), and a pre-emption notice (the node is drained with a
``--notice-s`` deadline, as the spot drainer does with EC2's notice; the run takes a just-in-time
checkpoint and a last one before the deadline, and shrinks).

``goodput`` (P4g) trains for ``--minutes`` with a pre-emption in the middle of every
``--preempt-every-min`` minutes: each drains a node with EC2's two-minute notice, the node goes at the
deadline, and a replacement joins ``--return-after-s`` later, as a spot autoscaler would bring one.
Checkpoints every 5 minutes, as a spot run would set them. Goodput = time on optimizer steps that
count / wall time since the first worker group started, measured over the whole window (not
extrapolated).
"""

import argparse
import json
import os
import tempfile
import threading
import time

import ray
from p8_loader_memory import write_dataset
from ray.cluster_utils import Cluster

from cluster.drain import drain_node
from train.config import load_config
from train.launch import run_training
from train.timeline import Progress, progress_of, timeline_of

SLOT = "bench_worker_slot"
NODE_DISKS = tempfile.mkdtemp(prefix="rw-elastic-disks-")


def wait_for(name: str, condition, run_thread: threading.Thread, timeout: float = 600) -> Progress:
    deadline = time.time() + timeout
    while time.time() < deadline and run_thread.is_alive():
        progress = progress_of(name)
        if condition(progress):
            return progress
        time.sleep(0.1)
    raise RuntimeError(f"run {name} did not reach the expected state: {progress_of(name)}")


def start_cluster() -> tuple[Cluster, list]:
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address)
    return cluster, [add_spot_node(cluster) for _ in range(3)]


def add_spot_node(cluster: Cluster):
    disk = tempfile.mkdtemp(dir=NODE_DISKS)
    return cluster.add_node(num_cpus=1, resources={SLOT: 1, "spot": 1}, env_vars={"TMPDIR": disk})


def random_dataset(gigabytes: float, seq_len: int) -> str:
    """A prepared dataset of ``gigabytes`` of random byte-level tokens (uint16, as nodes copy it)."""
    out = tempfile.mkdtemp(prefix="rw-elastic-data-")
    write_dataset(out, int(gigabytes * 1e9 // (2 * (seq_len + 1))), seq_len)
    return out


def bench_config(zero_stage: int, max_steps: int, *overrides: str):
    return load_config(
        "tiny",
        [
            f"run.storage_path={tempfile.mkdtemp(prefix='rw-elastic-')}",
            "run.name=elastic-bench",
            f"deepspeed.zero_stage={zero_stage}",
            "scaling.num_workers=[2,3]",
            f"scaling.resources_per_worker={{{SLOT}: 1}}",
            "scaling.resize_check_interval_s=5",
            "optim.global_batch_size=24",
            "optim.micro_batch_size=4",
            f"optim.max_steps={max_steps}",
            "run.log_every=25",
            f"run.eval_every={max_steps}",
            "cost.price_per_hour={spot: 1.0, ondemand: 3.0}",
            *overrides,
        ],
    )


def start_run(cfg) -> tuple[threading.Thread, list]:
    result = []
    run = threading.Thread(target=lambda: result.append(run_training(cfg)), daemon=True)
    run.start()
    return run, result


def preempt(cluster: Cluster, nodes: list, notice_s: float) -> None:
    """Drain the oldest spot node with a deadline; at the deadline the cloud takes it away."""
    node = nodes.pop(0)
    drain_node(node.node_id, deadline_s=notice_s)
    time.sleep(notice_s)  # nothing else ends a drained node here
    cluster.remove_node(node, allow_graceful=False)


def recovery(args: argparse.Namespace, cluster: Cluster, nodes: list) -> dict:
    data = [f"data.path={random_dataset(args.data_gb, load_config('tiny').model.seq_len)}"] if args.data_gb else []
    cfg = bench_config(args.zero_stage, args.max_steps, "checkpoint.every_steps=50", *data)
    run, result = start_run(cfg)
    name = cfg.run.name

    at = wait_for(name, lambda p: p.world_size == 3 and p.step >= 30, run)
    killed = time.time()
    cluster.remove_node(nodes.pop(), allow_graceful=False)
    first_step_after = wait_for(name, lambda p: p.attempts == at.attempts + 1 and p.step >= 1, run)
    p4 = time.time() - killed
    nodes.append(add_spot_node(cluster))
    at = wait_for(name, lambda p: p.world_size == 3 and p.attempts > first_step_after.attempts, run)

    at = wait_for(name, lambda p, a=at: p.step >= a.step + 40, run)
    preempt(cluster, nodes, args.notice_s)
    wait_for(name, lambda p, a=at: p.attempts == a.attempts + 1 and p.world_size == 2, run)
    run.join()
    elastic = result[0].elastic
    return {
        "P4_node_loss_to_first_step_s": p4,
        "steps_redone_per_restart": elastic.steps_redone / max(1, elastic.restarts),
        "goodput_measured": elastic.goodput,
        **elastic.model_dump(include={"wall_s", "resizes", "checkpoints"}, exclude_none=True),
    }


def goodput(args: argparse.Namespace, cluster: Cluster, nodes: list) -> dict:
    cfg = bench_config(args.zero_stage, 10**7, "checkpoint.every_steps=0", "checkpoint.every_minutes=5")
    run, _ = start_run(cfg)
    name = cfg.run.name
    wait_for(name, lambda p: p.world_size == 3 and p.step >= 1, run)
    started = time.time()
    for k in range(int(args.minutes // args.preempt_every_min)):
        # The node goes mid-period (minute 5, 15, 25 of 30), so the window holds whole periods.
        gone_at = started + 60 * (k + 0.5) * args.preempt_every_min
        time.sleep(max(0.0, gone_at - args.notice_s - time.time()))
        preempt(cluster, nodes, args.notice_s)
        time.sleep(args.return_after_s)
        nodes.append(add_spot_node(cluster))
    time.sleep(max(0.0, started + 60 * args.minutes - time.time()))
    elastic = ray.get(timeline_of(name).summary.remote())
    return {
        "P4g_goodput": elastic.goodput,
        **elastic.model_dump(include={"wall_s", "step_s", "resizes", "checkpoints"}, exclude_none=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario", choices=["recovery", "goodput"])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--notice-s", type=float, help="pre-emption deadline (default: 20 recovery, 120 goodput)")
    parser.add_argument("--max-steps", type=int, default=400, help="recovery: the run's length")
    parser.add_argument("--data-gb", type=float, default=0, help="recovery: train on this many GB of random tokens")
    parser.add_argument("--minutes", type=float, default=30, help="goodput: the measured window")
    parser.add_argument("--preempt-every-min", type=float, default=10)
    parser.add_argument("--return-after-s", type=float, default=60, help="goodput: a replacement node joins after")
    args = parser.parse_args()
    args.notice_s = args.notice_s or (20.0 if args.scenario == "recovery" else 120.0)
    cluster, nodes = start_cluster()
    scenario = recovery if args.scenario == "recovery" else goodput
    print(json.dumps(scenario(args, cluster, nodes), indent=2), flush=True)
    # After goodput the run's thread is still training: shutting down this process's Ray under it made
    # Ray's core worker end the process with status 1. Stop the cluster's processes and leave at once.
    for node in [*cluster.worker_nodes, cluster.head_node]:
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    os._exit(0)


if __name__ == "__main__":
    main()

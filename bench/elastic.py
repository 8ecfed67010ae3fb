"""P4 recovery seconds and P4g goodput of an elastic run on a simulated cluster.

    python bench/elastic.py [--notice-s 20] [--zero-stage 2] [--max-steps 400]

A head plus three one-worker spot nodes run the tiny recipe elastically between 2 and 3
workers, through the three events of a spot cluster: a node killed without notice (P4: seconds
from the kill to the first finished step after the resume), a replacement node joining (the run
grows back), and a pre-emption notice (the node is drained with a ``--notice-s`` deadline, as
the spot drainer does with EC2's notice; the run takes a just-in-time checkpoint and shrinks).

Goodput = time on optimizer steps that count / wall time, from the run's timeline. The run
here is short, so start-up and export weigh heavily in the measured figure. The figure for one
pre-emption every N minutes is extrapolated from the measured costs: each pre-emption costs a
shrink and, when capacity returns, a grow, so
goodput(N) = goodput between restarts x (1 - (seconds lost to pre-emption + to grow) / (60 N)).
"""

import argparse
import json
import os
import tempfile
import threading
import time

import ray
from ray.cluster_utils import Cluster

from cluster.drain import drain_node
from train.config import load_config
from train.launch import run_training
from train.timeline import progress_of

SLOT = "bench_worker_slot"


def wait_for(name: str, condition, run_thread: threading.Thread, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline and run_thread.is_alive():
        progress = progress_of(name)
        if condition(progress):
            return progress
        time.sleep(0.1)
    raise RuntimeError(f"run {name} did not reach the expected state: {progress_of(name)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--notice-s", type=float, default=20.0, help="pre-emption deadline (EC2 gives 120 s)")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=400)
    args = parser.parse_args()

    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address)
    nodes = [cluster.add_node(num_cpus=1, resources={SLOT: 1, "spot": 1}) for _ in range(3)]
    cfg = load_config(
        "tiny",
        [
            f"run.storage_path={tempfile.mkdtemp(prefix='rw-elastic-')}",
            "run.name=elastic-bench",
            f"deepspeed.zero_stage={args.zero_stage}",
            "scaling.num_workers=[2,3]",
            f"scaling.resources_per_worker={{{SLOT}: 1}}",
            "scaling.resize_check_interval_s=5",
            "optim.global_batch_size=24",
            "optim.micro_batch_size=4",
            f"optim.max_steps={args.max_steps}",
            "checkpoint.every_steps=50",
            "run.log_every=25",
            f"run.eval_every={args.max_steps}",
            "cost.price_per_hour={spot: 1.0, ondemand: 3.0}",
        ],
    )
    result = []
    run = threading.Thread(target=lambda: result.append(run_training(cfg)))
    run.start()
    name = cfg.run.name

    at = wait_for(name, lambda p: p["world_size"] == 3 and p["step"] >= 30, run)
    killed = time.time()
    cluster.remove_node(nodes.pop(), allow_graceful=False)
    first_step_after = wait_for(name, lambda p: p["attempts"] == at["attempts"] + 1 and p["step"] >= 1, run)
    p4 = time.time() - killed
    nodes.append(cluster.add_node(num_cpus=1, resources={SLOT: 1, "spot": 1}))
    at = wait_for(name, lambda p: p["world_size"] == 3 and p["attempts"] > first_step_after["attempts"], run)

    at = wait_for(name, lambda p, a=at: p["step"] >= a["step"] + 40, run)
    drain_node(nodes[0].node_id, deadline_s=args.notice_s)
    # At the deadline the cloud takes the instance away; nothing else ends a drained node here.
    time.sleep(args.notice_s)
    cluster.remove_node(nodes.pop(0), allow_graceful=False)
    wait_for(name, lambda p, a=at: p["attempts"] == a["attempts"] + 1 and p["world_size"] == 2, run)
    run.join()
    elastic = result[0].elastic

    resizes = elastic["resizes"]
    lost = {r["reason"]: r["seconds_lost"] for r in resizes}
    cycle_cost = lost["preemption"] + lost["capacity returned"]
    steady = elastic["step_s"] / (elastic["wall_s"] - sum(r["seconds_lost"] for r in resizes))
    report = {
        "P4_node_loss_to_first_step_s": p4,
        "resizes": resizes,
        "steps_redone_per_restart": elastic["steps_redone"] / max(1, elastic["restarts"]),
        "goodput_measured": elastic["goodput"],
        "wall_s": elastic["wall_s"],
        "seconds_lost_per_preemption_and_return": cycle_cost,
        "goodput_between_restarts": steady,
        "goodput_one_preemption_per_10_min": steady * (1 - cycle_cost / 600),
        "goodput_one_preemption_per_30_min": steady * (1 - cycle_cost / 1800),
        "cost": elastic.get("cost"),
        "cost_on_demand_only": elastic.get("cost_on_demand_only"),
    }
    print(json.dumps(report, indent=2))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()

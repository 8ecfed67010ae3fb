"""raywright's one change to Ray Train: restarts sized on the cluster as it is, and grows that wait for
the new node's copy of the data and a checkpoint (train/scaling_policy.py).

Run against Ray's own policy first, so that this fails when Ray stops needing the change: right after
a node is lost, Ray's policy still sizes the restart for the old cluster (Ray marks the node dead only
after its health checks fail, ~12 s here, and the coordinator's view is up to 20 s old); ours sizes it
for what is left.
"""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from ray._common.test_utils import wait_for_condition
from ray.train import ScalingConfig
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, ResizeDecision
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.drain import drain_node
from train.early_checkpoint import latest_restart_request, record_waiting_for_restart
from train.scaling_policy import FreshViewElasticPolicy

pytestmark = pytest.mark.cluster

SLOT = "scaling_policy_test_slot"  # only this test's nodes offer it


def _restart_size(policy) -> int | None:
    decision = policy.make_decision_for_non_running_worker_group()
    return decision.num_workers if isinstance(decision, ResizeDecision) else None


def _started(policy_class, run_id: str, **kwargs):
    scaling = ScalingConfig(
        num_workers=(1, 2), resources_per_worker={"CPU": 1, SLOT: 1}, elastic_resize_monitor_interval_s=0
    )
    policy = policy_class(scaling, **kwargs)
    policy.after_controller_start(SimpleNamespace(run_id=run_id))  # what the controller does at its start
    return policy


def test_a_restart_after_a_node_loss_is_sized_for_the_nodes_left(ray_cluster):
    nodes = [ray_cluster.add_node(num_cpus=1, resources={SLOT: 1}) for _ in range(2)]
    try:
        rays = _started(ElasticScalingPolicy, "rays-policy")
        wait_for_condition(lambda: _restart_size(rays) == 2, timeout=60)  # its view catches up within a tick

        ray_cluster.remove_node(nodes.pop(), allow_graceful=False)
        assert _restart_size(rays) == 2, (
            "Ray Train's elastic policy now sees a lost node at once: FreshViewElasticPolicy can go"
        )
        rays.before_controller_abort()  # withdraw its reservation

        ours = _started(FreshViewElasticPolicy, "raywright-policy", run_uri="/runs/policy-test", data_path="unused")
        assert _restart_size(ours) == 1
        ours.before_controller_abort()
    finally:
        for node in nodes:
            ray_cluster.remove_node(node, allow_graceful=False)


@ray.remote(num_cpus=1)
class Occupant:
    """Keeps a node busy (a task holding none of its resources would not): Ray ends an idle node at once
    when it is drained, a busy one at its deadline."""

    def ready(self) -> bool:
        return True


def test_a_restart_after_a_preemption_is_sized_without_the_draining_node_and_the_notice_shrinks_nothing(
    ray_cluster,
):
    """A pre-empted node can outlive its drain deadline (the cloud stops it a little later): a restart
    sized for it would wait out the worker-group start timeout, since Ray schedules nothing new there.
    Until the deadline the run trains on at its size: its workers on that node checkpoint before it."""
    nodes = [ray_cluster.add_node(num_cpus=2, resources={SLOT: 1}) for _ in range(2)]  # a CPU for the occupant
    policy = _started(FreshViewElasticPolicy, "drain-policy", run_uri="/runs/policy-test", data_path="unused")
    try:
        draining = nodes[1]
        pinned = NodeAffinitySchedulingStrategy(draining.node_id, soft=False)
        occupant = Occupant.options(scheduling_strategy=pinned).remote()  # held: a dropped handle ends the actor
        ray.get(occupant.ready.remote())
        wait_for_condition(lambda: _restart_size(policy) == 2, timeout=60)

        drain_node(draining.node_id, deadline_s=300)
        coordinator, requester = policy._autoscaling_coordinator, policy._requester_id
        fresh = ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True))
        assert draining.node_id in fresh, "Ray's view of the cluster now leaves draining nodes out: so can ours"
        time.sleep(ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S)  # the policy reads the cluster anew
        running = SimpleNamespace(num_workers=2, start_time=0.0)
        assert not isinstance(policy.make_decision_for_running_worker_group(running, None), ResizeDecision)
        assert _restart_size(policy) == 1
    finally:
        policy.before_controller_abort()
        for node in nodes:
            ray_cluster.remove_node(node, allow_graceful=False)


def _data_copies(node_tmpdir: Path) -> list[str]:
    """The splits a node holds node-local copies of (train/data.py keeps them under its $TMPDIR)."""
    return sorted(p.name for p in node_tmpdir.glob("raywright-data/*/*.u16"))


def test_a_grow_waits_until_every_node_has_the_data_then_for_a_checkpoint(ray_cluster, tiny_dataset, tmp_path):
    """Each node with its own $TMPDIR, as cloud nodes have their own disks: the node that joins has no copy."""
    tmpdirs = [tmp_path / "node-a", tmp_path / "node-b"]
    for tmpdir in tmpdirs:
        tmpdir.mkdir()
    nodes = [ray_cluster.add_node(num_cpus=1, resources={SLOT: 1}, env_vars={"TMPDIR": str(tmpdirs[0])})]
    run, began = str(tmp_path / "run"), time.time()
    policy = _started(FreshViewElasticPolicy, "grow-policy", run_uri=run, data_path=tiny_dataset)
    one_worker = SimpleNamespace(num_workers=1, start_time=0.0)
    try:
        nodes.append(ray_cluster.add_node(num_cpus=1, resources={SLOT: 1}, env_vars={"TMPDIR": str(tmpdirs[1])}))

        def copied_before_any_grow() -> bool:
            decision = policy.make_decision_for_running_worker_group(one_worker, None)
            assert not isinstance(decision, ResizeDecision), "grew before the new node had the data"
            return all(_data_copies(tmpdir) == ["train.u16", "val.u16"] for tmpdir in tmpdirs)

        def checkpoint_asked() -> bool:  # at a later poll than the one that saw the copies done, as the controller's
            decision = policy.make_decision_for_running_worker_group(one_worker, None)
            assert not isinstance(decision, ResizeDecision), "grew before asking the run for a checkpoint"
            return latest_restart_request(run) > began

        wait_for_condition(copied_before_any_grow, timeout=60, raise_exceptions=True)
        # then a checkpoint to restart from is asked of the run; the grow waits until the run waits at it
        wait_for_condition(checkpoint_asked, timeout=10, raise_exceptions=True)
        assert not isinstance(policy.make_decision_for_running_worker_group(one_worker, None), ResizeDecision)

        record_waiting_for_restart(run, latest_restart_request(run))  # rank 0, at the checkpoint that answers it
        decision = policy.make_decision_for_running_worker_group(one_worker, None)
        assert isinstance(decision, ResizeDecision) and decision.num_workers == 2
    finally:
        policy.before_controller_abort()
        for node in nodes:
            ray_cluster.remove_node(node, allow_graceful=False)


def test_a_grow_is_called_off_when_a_node_cannot_copy_the_data(ray_cluster, tmp_path, caplog):
    """A node gone or storage down while it copies: growing then would fail the restart; the run trains on."""
    nodes = [ray_cluster.add_node(num_cpus=1, resources={SLOT: 1}) for _ in range(2)]
    run, began = str(tmp_path / "run"), time.time()
    policy = _started(FreshViewElasticPolicy, "no-grow-policy", run_uri=run, data_path=str(tmp_path / "no-dataset"))
    one_worker = SimpleNamespace(num_workers=1, start_time=0.0)
    try:

        def called_off() -> bool:
            decision = policy.make_decision_for_running_worker_group(one_worker, None)
            assert not isinstance(decision, ResizeDecision), "grew though a node could not copy the data"
            return "could not copy the data: not growing" in caplog.text

        wait_for_condition(called_off, timeout=60)
        assert latest_restart_request(run) < began  # nor was a checkpoint asked of the run for it
    finally:
        policy.before_controller_abort()
        for node in nodes:
            ray_cluster.remove_node(node, allow_graceful=False)

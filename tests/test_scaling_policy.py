"""raywright's one change to Ray Train: restarts sized on the cluster as it is (train/scaling_policy.py).

Run against Ray's own policy first, so that this fails when Ray stops needing the change: right after
a node is lost, Ray's policy still sizes the restart for the old cluster (Ray marks the node dead only
after its health checks fail, ~12 s here, and the coordinator's view is up to 20 s old); ours sizes it
for what is left.
"""

from types import SimpleNamespace

import pytest
from ray._common.test_utils import wait_for_condition
from ray.train import ScalingConfig
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, ResizeDecision

from train.scaling_policy import FreshViewElasticPolicy

pytestmark = pytest.mark.cluster

SLOT = "scaling_policy_test_slot"  # only this test's nodes offer it


def _restart_size(policy) -> int | None:
    decision = policy.make_decision_for_non_running_worker_group()
    return decision.num_workers if isinstance(decision, ResizeDecision) else None


def _started(policy_class, run_id: str, **kwargs):
    policy = policy_class(ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1, SLOT: 1}), **kwargs)
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

        ours = _started(FreshViewElasticPolicy, "raywright-policy", run_uri="/runs/policy-test")
        assert _restart_size(ours) == 1
        ours.before_controller_abort()
    finally:
        for node in nodes:
            ray_cluster.remove_node(node, allow_graceful=False)

"""Shrink as soon as a node is gone: Ray Train's elastic policy, sizing each restart on a fresh view.

Ray Train 2.60's ``ElasticScalingPolicy`` sizes a (re)start from the reservations of Ray Data's
AutoscalingCoordinator, which re-reads the cluster every 20 s. After a node dies the restart is
therefore first tried at the old size and fails only when the worker-group start timeout expires
(P4 was 53 s, most of it that wait). Two things make the view fresh here: the coordinator recomputes
on demand (``get_reserved_resources(recompute=True)``, which Ray Data uses before pinning nodes), and,
since Ray itself marks a node dead only after its health checks fail (~12-15 s after a kill), a node
whose raylet no longer accepts a connection is left out of the count at once. This policy does both
whenever Ray's policy reads the cluster (at most once a second): for restarts, and for the periodic
check whether to grow, which would otherwise grow back onto a node that is already gone.

Growing back is Ray's decision too, but a grow restarts the run from its latest checkpoint, which
could be a whole checkpoint interval old. So the policy first asks the run for a checkpoint (through
Ray's KV store, train/early_checkpoint.py) and restarts it at the larger size once that checkpoint is
complete (or after ``GROW_CHECKPOINT_WAIT_S``): a planned grow redoes no steps.

It is the one change raywright makes to Ray Train, applied in one place (``ElasticTorchTrainer``);
``tests/test_scaling_policy.py`` fails when Ray's own policy stops needing it or changes shape.
"""

import logging
import socket
import time

import ray
from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import ReservedResources
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.execution.worker_group import WorkerGroupPollStatus, WorkerGroupState
from ray.train.v2._internal.util import time_monotonic

from train.early_checkpoint import latest_checkpoint_time, request_checkpoint

logger = logging.getLogger(__name__)


RAYLET_CONNECT_TIMEOUT_S = 0.5


def reachable_nodes(node_ids) -> set[str]:
    """The nodes among ``node_ids`` that Ray lists alive and whose raylet accepts a TCP connection."""
    reachable = set()
    for node in ray.nodes():
        if node["NodeID"] not in node_ids or not node["Alive"]:
            continue
        try:
            address = (node["NodeManagerAddress"], node["NodeManagerPort"])
            socket.create_connection(address, timeout=RAYLET_CONNECT_TIMEOUT_S).close()
            reachable.add(node["NodeID"])
        except OSError:
            logger.info("node %s does not answer: left out of the restart's size", node["NodeID"])
    return reachable


class FreshViewElasticPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, with restarts sized on the cluster as it is now, not up to 20 s ago, and
    grown only after a checkpoint of the run at ``run_uri``."""

    GROW_CHECKPOINT_WAIT_S = 60.0

    def __init__(self, scaling_config: ScalingConfig, run_uri: str):
        super().__init__(scaling_config)
        self.run_uri = run_uri
        self._pending_grow: tuple[ResizeDecision, float] | None = None  # and when its checkpoint was asked

    def make_decision_for_running_worker_group(
        self, worker_group_state: WorkerGroupState, worker_group_status: WorkerGroupPollStatus
    ) -> ScalingDecision:
        if self._pending_grow is not None:
            grow, asked = self._pending_grow
            if latest_checkpoint_time(self.run_uri) >= asked or time.time() - asked > self.GROW_CHECKPOINT_WAIT_S:
                self._pending_grow = None
                return grow
            return NoopDecision()
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers > worker_group_state.num_workers:
            logger.info("checkpointing before growing to %d workers", decision.num_workers)
            self._pending_grow = (decision, request_checkpoint(self.run_uri))
            return NoopDecision()
        return decision

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        self._pending_grow = None  # the run failed meanwhile: this restart is sized afresh
        return super().make_decision_for_non_running_worker_group()

    def _get_reserved_resources(self) -> ReservedResources | None:
        """What Ray's policy sizes every decision from (at most once a second): the coordinator's
        reservations, recomputed on the cluster as it is, less nodes whose raylet does not answer."""
        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        reserved = None
        try:
            fresh = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
            reachable = reachable_nodes(fresh)
            reserved = {node: resources for node, resources in fresh.items() if node in reachable}
        except Exception:  # as Ray's policy does: no decision this time
            logger.warning("could not get the cluster's resources; no scaling decision this time", exc_info=True)
        self._latest_reserved_resources_query_time = time_monotonic()
        self._latest_reserved_resources = reserved
        return reserved


class ElasticTorchTrainer(TorchTrainer):
    """A TorchTrainer whose elastic runs (``num_workers=(min, max)``) use ``FreshViewElasticPolicy``."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if isinstance(controller_init_kwargs.get("scaling_policy"), ElasticScalingPolicy):
            run_uri = self.train_loop_config["run_uri"]
            controller_init_kwargs["scaling_policy"] = FreshViewElasticPolicy(self.scaling_config, run_uri)
        return super()._initialize_and_run_controller(**controller_init_kwargs)

"""Shrink as soon as a node is gone: Ray Train's elastic policy, sizing each restart on a fresh view.

Ray Train 2.60's ``ElasticScalingPolicy`` sizes a (re)start from the reservations of Ray Data's
AutoscalingCoordinator, which re-reads the cluster every 20 s. After a node dies the restart is
therefore first tried at the old size and fails only when the worker-group start timeout expires
(P4 was 53 s, most of it that wait). Two things make the view fresh here: the coordinator recomputes
on demand (``get_reserved_resources(recompute=True)``, which Ray Data uses before pinning nodes), and,
since Ray itself marks a node dead only after its health checks fail (~12-15 s after a kill), a node
whose raylet no longer accepts a connection is left out of the count at once. This policy does both
whenever Ray's policy reads the cluster (at most once a second): for restarts, and for the periodic
check whether to grow, which would otherwise grow back onto a node that is already gone. A restart
also leaves out nodes being drained (a spot pre-emption): Ray schedules nothing new there, yet counts
their resources until they are gone, and a pre-empted node can outlive its drain deadline, where a
restart sized for it would wait out the worker-group start timeout. The periodic check keeps counting
them: the run's workers there train on until the deadline (train/loop.py checkpoints before it), and
leaving them out would shrink the run at the notice.

Growing back is Ray's decision too, but a grow restarts the run from its latest checkpoint, which
could be a whole checkpoint interval old, and the workers on a new node would first copy the training
data to it (train/data.py), every other worker waiting. So before a grow the policy has each node that
could hold a worker build its copy of the data, while the run trains on (up to ``GROW_DATA_WAIT_S``; a
copy that fails, a node gone or storage down, calls the grow off until Ray's policy decides it again);
then it asks the run for a checkpoint (through Ray's KV store, train/early_checkpoint.py) and restarts it
at the larger size once the run says that checkpoint is complete and it waits there (or after
``GROW_CHECKPOINT_WAIT_S``): a planned grow redoes no steps and waits for no copy.

It is the one change raywright makes to Ray Train, applied in one place (``ElasticTorchTrainer``);
``tests/test_scaling_policy.py`` fails when Ray's own policy stops needing it or changes shape.
"""

import logging
import socket
import time
from dataclasses import dataclass

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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from train.early_checkpoint import request_restart_checkpoint, restart_request_answered
from train.loop_args import LoopArgs
from train.node_copy import copy_to_this_node
from train.schema import parse

logger = logging.getLogger(__name__)


RAYLET_CONNECT_TIMEOUT_S = 0.5
# A task beside the run's workers, so it asks for no CPU.
copy_data_to_node = ray.remote(num_cpus=0, max_retries=0)(copy_to_this_node)


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
            logger.info("node %s does not answer: left out of the workers' count", node["NodeID"])
    return reachable


@dataclass
class PendingGrow:
    """A grow Ray's policy decided on, held back until the new nodes have the data and the run a checkpoint."""

    decision: ResizeDecision
    data_copies: list[ray.ObjectRef]  # one copy_data_to_node task per node that could hold a worker
    since: float
    checkpoint_asked: float | None = None


def nodes_with_room(reserved: ReservedResources, per_worker: dict[str, float]) -> list[str]:
    """The nodes whose reserved resources hold at least one worker."""
    return [node for node, free in reserved.items() if all(free.get(r, 0.0) >= n for r, n in per_worker.items())]


class FreshViewElasticPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, with restarts sized on the cluster as it is now, not up to 20 s ago, and
    grown only once the nodes have the run's data (at ``data_path``) and the run at ``run_uri`` a checkpoint."""

    GROW_DATA_WAIT_S = 1800.0  # past it the grow goes on, and the new node's workers copy the rest
    GROW_CHECKPOINT_WAIT_S = 60.0

    def __init__(self, scaling_config: ScalingConfig, run_uri: str, data_path: str):
        super().__init__(scaling_config)
        self.run_uri = run_uri
        self.data_path = data_path
        self._pending_grow: PendingGrow | None = None
        self._sizing_restart = False  # set while Ray's policy sizes a (re)start

    def make_decision_for_running_worker_group(
        self, worker_group_state: WorkerGroupState, worker_group_status: WorkerGroupPollStatus
    ) -> ScalingDecision:
        if self._pending_grow is not None:
            return self._advance(self._pending_grow)
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers > worker_group_state.num_workers:
            nodes = nodes_with_room(self._latest_reserved_resources or {}, decision.resources_per_worker)
            logger.info("copying the data to %d nodes before growing to %d workers", len(nodes), decision.num_workers)
            copies = [
                copy_data_to_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                    self.data_path
                )
                for node in nodes
            ]
            self._pending_grow = PendingGrow(decision, copies, time.time())
            return NoopDecision()
        return decision

    def _advance(self, grow: PendingGrow) -> ScalingDecision:
        """The pending grow's next stage: wait for the data copies, then for a checkpoint, then grow."""
        self._maybe_send_resource_request()  # as Ray's policy does at every poll: its request expires in 180 s
        now = time.time()
        if grow.checkpoint_asked is None:
            done, copying = ray.wait(grow.data_copies, num_returns=len(grow.data_copies), timeout=0)
            if copying and now - grow.since < self.GROW_DATA_WAIT_S:
                return NoopDecision()
            try:
                ray.get(done)
            except Exception:  # a node gone, storage down: a restart now would fail too
                logger.warning(
                    "a node could not copy the data: not growing; asked again at the next check", exc_info=True
                )
                self._pending_grow = None
                return NoopDecision()
            if copying:
                logger.warning("%d nodes still copy the data after %.0f s; growing", len(copying), now - grow.since)
            logger.info("checkpointing before growing to %d workers", grow.decision.num_workers)
            grow.checkpoint_asked = request_restart_checkpoint(self.run_uri)
            return NoopDecision()
        if restart_request_answered(self.run_uri) >= grow.checkpoint_asked or now - grow.checkpoint_asked > (
            self.GROW_CHECKPOINT_WAIT_S
        ):
            self._pending_grow = None
            return grow.decision
        return NoopDecision()

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        self._pending_grow = None  # the run failed meanwhile: this restart is sized afresh
        self._sizing_restart = True
        try:
            return super().make_decision_for_non_running_worker_group()
        finally:
            self._sizing_restart = False

    def _get_reserved_resources(self) -> ReservedResources | None:
        """What Ray's policy sizes every decision from: the fresh view, and for a restart that view less
        the nodes being drained."""
        reserved = self._fresh_reserved_resources()
        if reserved is None or not self._sizing_restart:
            return reserved
        try:
            draining = ray._private.state.state.get_draining_nodes()  # what Ray Train's PreemptionWatcher polls
        except Exception:  # as for the view itself: no decision this time
            logger.warning("could not get the nodes being drained; no scaling decision this time", exc_info=True)
            return None
        for node in draining.keys() & reserved.keys():
            logger.info("node %s is being drained: left out of the restart's size", node)
        return {node: resources for node, resources in reserved.items() if node not in draining}

    def _fresh_reserved_resources(self) -> ReservedResources | None:
        """The coordinator's reservations, recomputed on the cluster as it is (at most once a second), less
        nodes whose raylet does not answer."""
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
            args = parse(LoopArgs, self.train_loop_config)
            controller_init_kwargs["scaling_policy"] = FreshViewElasticPolicy(
                self.scaling_config, args.run_uri, args.data_path
            )
        return super()._initialize_and_run_controller(**controller_init_kwargs)

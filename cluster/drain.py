"""Drain a Ray node the way a spot pre-emption does: reason PREEMPTION, with a deadline.

Ray Train then reports the pre-emption to the workers (``ray.train.get_preemption_info()``),
which take a just-in-time checkpoint; Ray stops scheduling on the node. A busy node stays up, draining,
until something ends it: the cloud, at about the deadline (Ray's test ``Cluster`` never does); an idle
node Ray ends at once.
"""

import time

import ray
from ray.core.generated import autoscaler_pb2


def drain_node(node_id: str, deadline_s: float, message: str = "spot instance interruption notice") -> None:
    """Ask the GCS to drain ``node_id`` for pre-emption, ``deadline_s`` seconds from now."""
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, error = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        message,
        int((time.time() + deadline_s) * 1000),
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {error}")

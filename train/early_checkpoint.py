"""An early checkpoint asked of every training run on the cluster, through Ray's KV store.

The spot drainer asks on a rebalance recommendation; rank 0 of each run reads the request at its
pre-emption polls and the run checkpoints once, unless a checkpoint already followed the request.
Kept free of torch: the drainer imports it.
"""

import time

from ray.experimental import internal_kv

CHECKPOINT_REQUEST_KEY = b"raywright/checkpoint-request"  # in Ray's KV store: the time of the latest request


def latest_checkpoint_request() -> float:
    """When an early checkpoint was last requested on this cluster (0: never), e.g. by the spot drainer
    after a rebalance recommendation."""
    value = internal_kv._internal_kv_get(CHECKPOINT_REQUEST_KEY)
    return float(value) if value else 0.0


def request_checkpoint() -> None:
    """Ask every training run on this cluster for an early checkpoint (at its next pre-emption poll)."""
    internal_kv._internal_kv_put(CHECKPOINT_REQUEST_KEY, str(time.time()).encode(), overwrite=True)

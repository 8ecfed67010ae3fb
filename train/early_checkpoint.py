"""Early checkpoints asked of training runs, and the time of each run's latest one, through Ray's KV store.

The spot drainer asks every run on the cluster (a rebalance recommendation); the scaling policy asks one
run for a checkpoint to restart it from at a larger size (train/scaling_policy.py). Rank 0 reads both
requests at its pre-emption polls and the run checkpoints once, unless a checkpoint already followed the
request; after every checkpoint rank 0 records its time, which tells the scaling policy its request was
answered. Asked for a restart, the run then waits for it rather than train steps the restart would redo.
Kept free of torch: the drainer imports it.
"""

import hashlib
import time

from ray.experimental import internal_kv

CHECKPOINT_REQUEST_KEY = b"raywright/checkpoint-request"  # in Ray's KV store: the time of the latest request


def _run_key(kind: str, run_uri: str) -> bytes:
    return f"raywright/{kind}/{hashlib.sha256(run_uri.encode()).hexdigest()[:16]}".encode()


def _time_at(key: bytes) -> float:
    value = internal_kv._internal_kv_get(key)
    return float(value) if value else 0.0


def _put_time(key: bytes, when: float) -> float:
    internal_kv._internal_kv_put(key, str(when).encode(), overwrite=True)
    return when


def latest_checkpoint_request(run_uri: str) -> float:
    """When an early checkpoint was last asked of this run or of every run (0: never)."""
    return max(_time_at(CHECKPOINT_REQUEST_KEY), latest_restart_request(run_uri))


def latest_restart_request(run_uri: str) -> float:
    """When this run was last asked for a checkpoint to be restarted from (0: never)."""
    return _time_at(_run_key("restart-request", run_uri))


def request_checkpoint() -> float:
    """Ask every training run on this cluster for an early checkpoint, taken at its next pre-emption poll;
    returns the request's time."""
    return _put_time(CHECKPOINT_REQUEST_KEY, time.time())


def request_restart_checkpoint(run_uri: str) -> float:
    """Ask the run at ``run_uri`` for a checkpoint, taken at its next pre-emption poll, that it is about to be
    restarted from; returns the request's time."""
    return _put_time(_run_key("restart-request", run_uri), time.time())


def record_checkpoint(run_uri: str, when: float) -> None:
    """Rank 0, after each complete checkpoint of the run."""
    _put_time(_run_key("checkpoint-saved", run_uri), when)


def latest_checkpoint_time(run_uri: str) -> float:
    """When the run's latest checkpoint completed, as recorded in this Ray cluster (0: none yet)."""
    return _time_at(_run_key("checkpoint-saved", run_uri))

"""Early checkpoints asked of training runs, through Ray's KV store.

The spot drainer asks every run on the cluster (a rebalance recommendation); the run checkpoints once, at
its next pre-emption poll, unless a checkpoint already followed the request. The scaling policy asks one
run for a checkpoint to restart it from at a larger size (train/scaling_policy.py): the run checkpoints at
its next poll, then waits for the restart rather than train steps it would redo, and rank 0 says so, which
tells the policy to restart it. Rank 0 reads both requests. Kept free of torch: the drainer imports it.
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


def record_waiting_for_restart(run_uri: str, request: float) -> None:
    """Rank 0, once the checkpoint that answers the restart request made at ``request`` counts and the run waits."""
    _put_time(_run_key("waiting-for-restart", run_uri), request)


def restart_request_answered(run_uri: str) -> float:
    """The time of the latest restart request the run answered with a checkpoint it now waits at (0: none)."""
    return _time_at(_run_key("waiting-for-restart", run_uri))

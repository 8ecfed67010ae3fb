"""A run is owned: a second driver of the same run is refused, a gone one is taken over (no Ray)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from ray._common.test_utils import wait_for_condition

from train import storage
from train.cli import take_sigterm_as_ctrl_c
from train.lease import LEASE, Lease, RunOwnedError
from train.schema import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture(params=["local", "s3"])
def run_uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"{request.getfixturevalue('s3_bucket')}/lease-{time.time_ns()}/run"


def test_a_second_driver_of_a_live_run_is_refused_with_the_owner_named(run_uri):
    with Lease(run_uri, stale_after_s=300):
        with pytest.raises(RunOwnedError) as refused:
            Lease(run_uri, stale_after_s=300).acquire()
    message = str(refused.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    assert "run.lease_stale_after_s" in message and "run.name" in message
    Lease(run_uri, stale_after_s=300).acquire()  # released at the end of the first run


def _write_lease(run_uri: str, pid: int, heartbeat: float) -> None:
    owner = {"host": socket.gethostname(), "pid": pid, "token": "someone-else", "heartbeat": heartbeat}
    storage.write_json(storage.join(run_uri, LEASE), owner)


def test_a_lease_without_heartbeat_is_taken_over(run_uri):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lease(run_uri, alive.pid, heartbeat=time.time() - 301)
        Lease(run_uri, stale_after_s=300).acquire()
        _write_lease(run_uri, alive.pid, heartbeat=time.time())
        with pytest.raises(RunOwnedError):  # the same owner with a fresh heartbeat is live
            Lease(run_uri, stale_after_s=300).acquire()
    finally:
        alive.kill()


def test_a_killed_driver_of_this_host_is_taken_over_at_once(run_uri):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lease(run_uri, int(dead.stdout), heartbeat=time.time())
    lease = Lease(run_uri, stale_after_s=300)
    lease.acquire()
    assert json.loads(storage.read_bytes(storage.join(run_uri, LEASE)))["token"] == lease.token


def test_a_lease_that_is_not_one_is_named_and_left_as_it_is(run_uri):
    """A lease.json no driver can read: none can tell whether a driver holds it, so none takes it over."""
    lease_uri = storage.join(run_uri, LEASE)
    for unreadable, why in [(b'{"host": "a", "pi', "not JSON: "), (b'{"host": "a"}', "pid: required")]:
        storage.write_bytes(lease_uri, unreadable)
        with pytest.raises(ConfigError) as refused:
            Lease(run_uri, stale_after_s=300).acquire()
        assert str(refused.value).startswith(f"{lease_uri} is not a lease this raywright reads ({why}")
        assert str(refused.value).endswith("if no driver is training this run, delete it")
        assert storage.read_bytes(lease_uri) == unreadable


@pytest.mark.parametrize("on_ctrl_c", [signal.default_int_handler, signal.SIG_IGN], ids=["handled", "ignored"])
def test_a_driver_that_lost_its_lease_stops(tmp_path, on_ctrl_c):
    """Whether Ctrl-C has Python's own handler or is ignored, as in a script's background job: there the command
    line's SIGTERM handler stops the driver. (A Ray Train run earlier in this process may have left its handler,
    which aborts that run's controller instead: what a training driver wants; invisible here.)"""
    run_uri = str(tmp_path / "run")
    previous = signal.signal(signal.SIGINT, on_ctrl_c), signal.getsignal(signal.SIGTERM)
    take_sigterm_as_ctrl_c()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt), Lease(run_uri, stale_after_s=0.5):
            _write_lease(run_uri, 1, heartbeat=time.time())  # taken over while this driver was paused
            time.sleep(30)  # the heartbeat (every 0.1 s) interrupts this, as Ctrl-C would
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    assert time.monotonic() - start < 5
    assert json.loads(storage.read_bytes(storage.join(run_uri, LEASE)))["token"] == "someone-else"  # not ours


def test_a_driver_keeps_its_lease_through_a_storage_outage(s3_server, s3_bucket, capfd):
    """Renewals that fail while storage is down are retried; only a lease found in another's hands stops a run."""
    lease_uri = f"{s3_bucket}/lease-{time.time_ns()}/run/{LEASE}"
    with Lease(os.path.dirname(lease_uri), stale_after_s=1.0) as lease:  # a beat every 0.2 s
        with s3_server.outage():
            time.sleep(8)  # a failed renewal takes pyarrow ~6 s of retries
        beat = storage.read_json(lease_uri)["heartbeat"]
        wait_for_condition(lambda: storage.read_json(lease_uri)["heartbeat"] > beat, timeout=15)
        assert storage.read_json(lease_uri)["token"] == lease.token
    assert "could not renew the lease" in capfd.readouterr().err
    assert not storage.exists(lease_uri)  # released

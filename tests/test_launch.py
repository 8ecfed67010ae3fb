"""The private Ray that ``python -m train`` starts where no cluster is named, beside another Ray on the machine."""

import os
import socket
import subprocess
import sys

import pytest

from train.process_group import free_port

# Asks the state API from a process of the private Ray, as Ray Train's placement-group cleaner does for a run.
FIND_ITSELF = """
import ray
from ray.util.state import get_actor
from train.config import load_config
from train.launch import init_ray

assert init_ray(load_config("tiny"))

@ray.remote(num_cpus=0)
class Probe:
    def find_itself(self):
        found = get_actor(ray.get_runtime_context().get_actor_id(), timeout=10)
        return found.state if found else "not found"

print(ray.get(Probe.remote().find_itself.remote()))
"""


@pytest.mark.cluster
def test_a_private_ray_asks_its_own_state_api_not_the_one_ray_start_recorded(ray_session):
    """The session's Ray wrote its address where `ray start` does, so Ray's state API finds that one by default.
    Asked there, Ray Train's cleaner took a private run's controller for dead and removed its workers."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", FIND_ITSELF], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "ALIVE"


@pytest.mark.unit
def test_the_dashboard_port_is_the_preferred_one_where_free_else_another_free_one():
    port = free_port()
    assert free_port(prefer=port) == port
    with socket.socket() as taken:  # another Ray's dashboard on the preferred port
        taken.bind(("127.0.0.1", port))
        taken.listen()
        other = free_port(prefer=port)
    assert other != port and other > 0

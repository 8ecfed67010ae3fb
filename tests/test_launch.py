"""The private Ray that ``python -m train`` starts where no cluster is named, beside another Ray on the machine, and
the command stopped before its run trains."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from train.lease import LEASE
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


@pytest.mark.cluster
def test_python_m_train_stopped_while_it_prepares_its_dataset_stops_at_once_and_keeps_none_of_it(tmp_path):
    """SIGTERM (kill, ``ray job stop``) while the dataset is prepared, with SIGINT ignored as a background job of a
    non-interactive shell starts: relayed as SIGINT, it went unheard and the run trained on."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy dog.\n" * 400)
    runs = tmp_path / "runs"
    train = [sys.executable, "-m", "train", "--set", f"data.source={corpus}", "--set", f"run.storage_path={runs}"]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    process = subprocess.Popen(
        ["bash", "-c", 'trap "" INT && exec "$@"', "bash", *train],  # exec keeps SIGINT ignored
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if line.startswith("preparing dataset"):
                process.send_signal(signal.SIGTERM)
                break
        output.append(process.communicate(timeout=60)[0])
    finally:
        process.kill()
    assert process.returncode == 130 and "\ninterrupted\n" in "".join(output), "".join(output)
    assert list(runs.glob("datasets/*")) == []  # nothing half-prepared
    assert not (runs / "tiny" / LEASE).exists()  # released

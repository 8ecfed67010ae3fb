"""The private Ray that ``python -m train`` starts where no cluster is named, beside another Ray on the machine, and
the command stopped before its run trains."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from train.launch import run_training
from train.lease import LEASE
from train.process_group import free_port
from train.timeline import read_saved_state

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


@pytest.mark.cluster
def test_a_run_stopped_mid_training_resumes_as_a_new_segment_of_its_record(tiny_config):
    """SIGTERM (``ray job stop``) while training: the command says it was interrupted, exit 130 (Ray's abort ended
    it with Ray's exit code 1), and the driver that resumes the run later neither counts a restart nor the time the
    run was stopped (before, a stopped driver was taken for one that died, its downtime for seconds lost)."""
    cfg = tiny_config("run.name=stopped", "optim.max_steps=60", "run.log_every=5", "checkpoint.every_steps=10")
    overrides = [f"{key}={value}" for key, value in (
        ("data.path", cfg.data.path), ("run.storage_path", cfg.run.storage_path), ("run.name", "stopped"),
        ("optim.max_steps", 60), ("run.log_every", 5), ("checkpoint.every_steps", 10),
    )]  # fmt: skip
    command = [sys.executable, "-m", "train", *(arg for o in overrides for arg in ("--set", o))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # the session Ray
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if "step 25/60" in line:
                process.send_signal(signal.SIGTERM)
                break
        output.append(process.communicate(timeout=120)[0])
    finally:
        process.kill()
    assert process.returncode == 130 and "\ninterrupted\n" in "".join(output), "".join(output)[-3000:]
    time.sleep(5)  # the run stopped: not its time

    summary = run_training(cfg)
    elastic = summary.elastic
    assert summary.steps == 60 and elastic.restarts == 0 and elastic.resizes == []
    first, resumed = (segment.from_step for segment in elastic.world_size_timeline)
    assert first == 0 and 20 <= resumed < 60 and resumed % 10 == 0  # a checkpoint from when it was stopped
    attempts = read_saved_state(summary.run_dir).attempts
    assert elastic.wall_s == pytest.approx(sum(a.end - a.start for a in attempts), abs=0.01)

"""The one-process group of a DeepSpeed engine outside Ray Train (a sweep trial, an export) leaves nothing behind;
a port chosen for another process to bind later is one that no outgoing connection is given meanwhile."""

import ast
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from train import process_group
from train.process_group import CHOSEN_PORTS_FROM, LINUX_EPHEMERAL_PORTS, free_port, free_ports

# In a process of its own: the test process may hold the session's group already.
SCRIPT = """
import os
import torch.distributed as dist
from train.process_group import one_process_group

os.environ["MASTER_PORT"] = "the user's"
with one_process_group(use_gpu=False):
    assert dist.get_world_size() == 1 and (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("0", "0")
print({name: os.environ.get(name) for name in {names}}, dist.is_initialized())
"""
NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.mark.unit
def test_the_group_and_its_launcher_variables_are_gone_after_the_block():
    env = {name: value for name, value in os.environ.items() if name not in NAMES}  # the session group's LOCAL_RANK
    script = SCRIPT.replace("{names}", repr(NAMES))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    left, initialized = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    expected = {"MASTER_ADDR": None, "MASTER_PORT": "the user's", "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}
    assert ast.literal_eval(left) == expected and initialized == "False"


@pytest.mark.unit
@pytest.mark.skipif(not Path(LINUX_EPHEMERAL_PORTS).exists(), reason="reads Linux's ephemeral port range")
def test_a_chosen_port_is_outside_the_range_the_kernel_gives_outgoing_connections():
    """A Ray starting up makes many connections: one chosen from that range was taken before HAProxy bound it."""
    first, last = map(int, Path(LINUX_EPHEMERAL_PORTS).read_text().split())
    if first <= CHOSEN_PORTS_FROM:
        pytest.skip(f"this machine gives outgoing connections every port from {first}")
    chosen = free_ports(50)
    assert len(set(chosen)) == 50, chosen  # different ports, for the processes of one Ray
    assert not [port for port in chosen if first <= port <= last], chosen
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", chosen[0]))  # and free
    # Processes that seeded Python's random module alike (a run's seed) do not choose alike.
    random.seed(0)
    one = [free_port() for _ in range(3)]
    random.seed(0)
    assert [free_port() for _ in range(3)] != one


@pytest.mark.unit
def test_a_machine_that_leaves_no_port_outside_its_ephemeral_range_still_gets_different_free_ports(monkeypatch):
    monkeypatch.setattr(process_group, "CHOSEN_PORTS_FROM", 65536)
    chosen = free_ports(5)
    assert len(set(chosen)) == 5 and all(0 < port < 65536 for port in chosen), chosen

"""A local storage path on a Ray cluster of two machines, one of which cannot see it.

The second machine is a Ray node at another address (127.0.0.2) in a mount namespace of its own, where an empty
tmpfs hides the folder: what a node of another machine sees of a path on the driver's disk.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from train.process_group import free_ports

pytestmark = pytest.mark.cluster

OTHER_MACHINE = "127.0.0.2"
# As cluster.yaml runs every node, and as its drivers connect (the token is ~/.ray/auth_token).
TOKEN_AUTH = {**{key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}


def _can_unshare() -> bool:
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


def _start(command: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", command], env=TOKEN_AUTH, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _python(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout, a driver of the two-machine Ray."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env={**TOKEN_AUTH, **env}, capture_output=True, text=True, timeout=300
    )


def _stop(process: subprocess.Popen) -> None:
    """The machine switched off: its node's processes, one process group, killed at once (`ray start --block` takes
    ~30 s to stop them on SIGTERM)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory) -> Iterator[tuple[str, Path, Path]]:
    """The address of a Ray of two nodes, a folder the second does not see, and one it does."""
    if not _can_unshare():
        pytest.skip("needs unshare -m (a mount namespace) to hide a folder from one node")
    root = tmp_path_factory.mktemp("machines")
    hidden, shared = root / "hidden", root / "shared"
    hidden.mkdir()
    shared.mkdir()
    # Short: Ray's socket paths live under it.
    ray_dir = tempfile.mkdtemp(prefix="rw-", dir="/tmp")
    port, dashboard = free_ports(2)
    address = f"127.0.0.1:{port}"
    head = _start(
        f"exec ray start --head --block --port={port} --num-cpus=0 --dashboard-port={dashboard} --temp-dir={ray_dir}",
        root / "head.log",
    )
    other = None
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in (root / "head.log").read_text():
            assert head.poll() is None and time.time() < deadline, (root / "head.log").read_text()
            time.sleep(1)
        other = _start(
            f"unshare -m --propagation private bash -c 'mount -t tmpfs none {hidden} && exec ray start --block "
            f"--address={address} --node-ip-address={OTHER_MACHINE} --num-cpus=1'",
            root / "other.log",
        )
        while "Ray runtime started" not in (root / "other.log").read_text():
            assert other.poll() is None and time.time() < deadline, (root / "other.log").read_text()
            time.sleep(1)
        yield address, hidden, shared
    finally:
        for process in (other, head):
            if process is not None:
                _stop(process)
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_local_storage_path_that_another_machine_cannot_see_is_one_line_before_anything_is_written(two_machines):
    """Before, the dataset's shards went to the other machine's disk and the run failed saying that the corpus
    "gives no train sequence"."""
    address, hidden, _ = two_machines
    done = _python("-m", "train", "--set", f"run.ray_address={address}", "--set", f"run.storage_path={hidden}")
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stderr.splitlines()[-1]
    assert said.startswith(f"config error: run.storage_path: {hidden} is a folder of this machine ("), said
    assert said.endswith(
        f") that the node at {OTHER_MACHINE} of this Ray cluster cannot see; on a cluster of several machines use "
        "object storage (s3://...) or a folder every node mounts"
    )
    assert not (hidden / "datasets").exists() and not list(hidden.rglob(".raywright-shared-check-*"))


def test_a_folder_every_node_sees_passes_and_the_check_names_the_setting_whose_folder_one_does_not(two_machines):
    address, hidden, shared = two_machines
    check = (
        "import ray, sys; ray.init(address=sys.argv[1]); from train.shared_storage import check_nodes_share; "
        "check_nodes_share([('data.path', sys.argv[2] + '/prepared/here'), ('run.storage_path', sys.argv[3])])"
    )
    done = _python("-c", check, address, str(shared), str(hidden))
    assert done.returncode == 1 and f"ConfigError: run.storage_path: {hidden} is a folder" in done.stderr
    assert "data.path" not in done.stderr.splitlines()[-1]
    assert not list(shared.rglob(".raywright-shared-check-*"))


def test_serving_a_local_checkpoint_that_another_machine_cannot_see_is_one_line(two_machines, memorized_export):
    """Before, the replicas, placed on the other machine (the head has no CPU), failed to load it on every restart
    and the command waited on them."""
    address, hidden, _ = two_machines
    checkpoint = hidden / "memorized"
    shutil.copytree(memorized_export, checkpoint)
    done = _python("-m", "serve", "--checkpoint", str(checkpoint), "--port", str(free_ports(1)[0]), RAY_ADDRESS=address)
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stderr.splitlines()[-1]
    assert said.startswith(f"config error: checkpoint: {checkpoint} is a folder of this machine ("), said
    assert sorted(path.name for path in checkpoint.iterdir()) == sorted(os.listdir(memorized_export))

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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ray._common.test_utils import wait_for_condition

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


def _train(address: str, storage_path: Path) -> list[str]:
    """The arguments of ``python -m train`` on the Ray at ``address``, its runs in ``storage_path``."""
    return ["-m", "train", "--set", f"run.ray_address={address}", "--set", f"run.storage_path={storage_path}"]


def _stop(process: subprocess.Popen) -> None:
    """The machine switched off: its node's processes, one process group, killed at once (`ray start --block` takes
    ~30 s to stop them on SIGTERM)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@contextlib.contextmanager
def _node(command: str, log: Path) -> Iterator[None]:
    """A Ray node that ``command`` starts, up for the block."""
    process = _start(command, log)
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in log.read_text():
            assert process.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(1)
        yield
    finally:
        _stop(process)


@contextlib.contextmanager
def _head(root: Path) -> Iterator[str]:
    """The head of a Ray, with no CPU for work (as cluster.yaml's), up for the block; its address."""
    ray_dir = tempfile.mkdtemp(prefix="rw-", dir="/tmp")  # short: Ray's socket paths live under it
    port, dashboard = free_ports(2)
    try:
        with _node(
            f"exec ray start --head --block --port={port} --num-cpus=0 --dashboard-port={dashboard} "
            f"--temp-dir={ray_dir}",
            root / "head.log",
        ):
            yield f"127.0.0.1:{port}"
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def _other_machine(address: str, hidden: Path, log: Path, cpus: int = 1) -> contextlib.AbstractContextManager[None]:
    """A node of the Ray at ``address`` on another machine, one that does not see ``hidden``."""
    return _node(
        f"unshare -m --propagation private bash -c 'mount -t tmpfs none {hidden} && exec ray start --block "
        f"--address={address} --node-ip-address={OTHER_MACHINE} --num-cpus={cpus}'",
        log,
    )


@pytest.fixture(scope="module")
def can_unshare() -> None:
    if not _can_unshare():
        pytest.skip("needs unshare -m (a mount namespace) to hide a folder from one node")


def _run_as_a_node_joins(root: Path, hidden: Path, args: Callable[[str], list[str]], asked: str) -> tuple[int, str]:
    """Run ``python ARGS`` (``args`` of the Ray's address) on a Ray whose only node is its head, as cluster.yaml's
    starts; once the command has said ``asked`` (after it asked the nodes there), a node that does not see
    ``hidden`` joins, as an autoscaler's does. The command's exit code and its error lines."""
    out, err = root / "run.out", root / "run.err"
    with _head(root) as address:
        run = subprocess.Popen(
            [sys.executable, *args(address)], cwd=REPO, env=TOKEN_AUTH, stdout=out.open("w"), stderr=err.open("w")
        )
        try:
            # The node takes seconds to start: the command is past its own check by then.
            wait_for_condition(lambda: asked in out.read_text() + err.read_text(), timeout=120)
            with _other_machine(address, hidden, root / "other.log", cpus=2):
                code = run.wait(timeout=300)
        finally:
            run.kill()
    return code, "\n".join(line for line in err.read_text().splitlines() if line.startswith(("error", "config error")))


def _train_as_a_node_joins(root: Path, hidden: Path, *settings: str) -> str:
    """What ``python -m train`` with its storage in ``hidden`` (and ``settings``) says as a node that does not see
    it joins while the run waits for workers; it exits with code 2."""
    sets = [arg for setting in settings for arg in ("--set", setting)]
    code, said = _run_as_a_node_joins(
        root, hidden, lambda address: [*_train(address, hidden), *sets], "waiting for the cluster to add nodes"
    )
    assert code == 2, said
    return said


def test_a_node_that_joins_after_the_run_started_and_cannot_see_its_storage_stops_the_run_in_one_line(
    can_unshare, tmp_path
):
    """Before, the dataset's shards went to the late node's disk, and the run blamed the corpus. First in this file:
    it runs before the module's two-machine Ray starts."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    said = _train_as_a_node_joins(tmp_path, hidden)  # naming the dataset's folder, which run.storage_path places
    assert said.startswith(f"config error: run.storage_path: {hidden}/datasets/"), said
    assert "is a folder of this machine (" in said and f"node at {OTHER_MACHINE} of this Ray cluster cannot" in said
    assert not list(hidden.rglob("*.parquet")) and not list(hidden.rglob(".raywright-shared-check-*"))


def test_training_workers_on_a_node_that_cannot_see_the_runs_folder_stop_the_run_in_one_line(
    can_unshare, tmp_path, tiny_dataset
):
    """The dataset in a folder every node sees, the run's in one the late node does not. Before, the run trained
    there, wrote its checkpoints and export to that node's disk, and said it had ended well: exit code 0, and no
    model where it said."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    said = _train_as_a_node_joins(tmp_path, hidden, f"data.path={tiny_dataset}", "optim.max_steps=10")
    assert said.startswith(f"config error: run.storage_path: {hidden} is a folder of this machine ("), said
    assert said.endswith(
        f") that the node at {OTHER_MACHINE} of this Ray cluster cannot see; on a cluster of several machines use "
        "object storage (s3://...) or a folder every node mounts"
    )


def test_sweep_trials_on_a_node_that_cannot_see_the_sweeps_folder_fail_naming_it(can_unshare, tmp_path, tiny_dataset):
    """Before, the trial trained there, its run (checkpoints, metrics) on that node's disk, and the sweep ended well:
    its trials could not resume from their checkpoints, and its summary lacked their runs."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        "name: late\nbase: tiny\nnum_trials: 1\nmax_concurrent_trials: 1\ngrace_period: 4\n"
        f"set: [optim.max_steps=10, optim.warmup_steps=2, run.eval_every=5, data.path={tiny_dataset}]\n"
        "space: {optim.lr: {loguniform: [1.0e-4, 3.0e-2]}}\ntrial_resources: {CPU: 1}\n"
        f"storage_path: {hidden}\n"
    )
    code, said = _run_as_a_node_joins(
        tmp_path,
        hidden,
        lambda address: ["-m", "tune", "--config", str(sweep), "--set", f"ray_address={address}"],
        "Trial status: 1 PENDING",
    )
    assert code == 1 and said.startswith("error: sweep 'late': no trial reported val_loss; trial "), said
    assert f"failed: train.stops.StorageNotSharedError: storage_path: {hidden} is a folder of this machine (" in said
    assert f"the node at {OTHER_MACHINE} of this Ray cluster cannot see" in said


@pytest.fixture(scope="module")
def two_machines(can_unshare, tmp_path_factory) -> Iterator[tuple[str, Path, Path]]:
    """The address of a Ray of two nodes, a folder the second does not see, and one it does."""
    root = tmp_path_factory.mktemp("machines")
    hidden, shared = root / "hidden", root / "shared"
    hidden.mkdir()
    shared.mkdir()
    with _head(root) as address, _other_machine(address, hidden, root / "other.log"):
        yield address, hidden, shared


def test_a_local_storage_path_that_another_machine_cannot_see_is_one_line_before_anything_is_written(two_machines):
    """Before, the dataset's shards went to the other machine's disk and the run failed saying that the corpus
    "gives no train sequence"."""
    address, hidden, _ = two_machines
    done = _python(*_train(address, hidden))
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

"""cluster.yaml offline (Ray's schema, security properties, Ray's AWS provider on moto), the spot drainer,
and the local twin driven through the job CLI."""

import copy
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
import ray
import yaml
from moto import mock_aws
from ray._common.test_utils import wait_for_condition
from ray.autoscaler._private.aws.config import bootstrap_aws
from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.tags import NODE_KIND_WORKER, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME, TAG_RAY_USER_NODE_TYPE

from cluster import local
from cluster.__main__ import main as cluster_main
from cluster.jobs import auth_headers, connect
from cluster.spot_drainer import Imds, wait_for_metadata, watch
from tests.conftest import REPO, interrupt_when
from train.early_checkpoint import latest_checkpoint_request
from train.schema import ConfigError

WORKER_TYPES = {"gpu.ondemand": None, "gpu.spot": "spot", "cpu.spot": "spot"}  # type -> EC2 lifecycle


@pytest.fixture(scope="module")
def cluster_config() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


@pytest.mark.unit
def test_cluster_yaml_passes_rays_own_validation(cluster_config):
    prepared = prepare_config(copy.deepcopy(cluster_config))
    validate_config(prepared)
    assert set(prepared["available_node_types"]) == {"ray.head.default", *WORKER_TYPES}


@pytest.mark.unit
def test_cluster_yaml_is_safe_by_default(cluster_config):
    head = " ".join(cluster_config["head_start_ray_commands"])
    workers = " ".join(cluster_config["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert cluster_config["provider"]["cache_stopped_nodes"] is False
    # Token auth on every node, the token shipped by file_mounts.
    assert "RAY_AUTH_MODE=token" in head and all(
        "RAY_AUTH_MODE=token" in command for command in cluster_config["worker_start_ray_commands"][1:]
    )
    assert cluster_config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "--address=$RAY_HEAD_IP:6379" in workers
    # Pinned releases, never Ray's development wheel.
    setup = " ".join(cluster_config["setup_commands"])
    assert '"ray[train,tune,serve]==2.60.0"' in setup and "torch==2.13.0" in setup
    assert "dev0" not in setup and "ray-wheels" not in setup
    # The head runs no work; spot and on-demand capacity are told apart by resources.
    types = cluster_config["available_node_types"]
    assert types["ray.head.default"]["resources"] == {"CPU": 0}
    for name, lifecycle in WORKER_TYPES.items():
        market = types[name]["node_config"].get("InstanceMarketOptions", {}).get("MarketType")
        assert market == lifecycle and types[name]["resources"] == {lifecycle or "ondemand": 1}
    assert cluster_config["provider"]["security_group"]["IpPermissions"] == []


@pytest.mark.unit
def test_rays_aws_provider_on_moto_creates_every_worker_type_and_opens_only_ssh(cluster_config, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")  # Ray attaches AWS-managed policies
    region = cluster_config["provider"]["region"]
    with mock_aws():
        iam = boto3.client("iam", region_name=region)
        for who in ("head", "worker"):  # as cluster.yaml's header tells the user to, from cluster/iam/
            trust = (REPO / "cluster" / "iam" / "ec2-trust.json").read_text()
            iam.create_role(RoleName=f"raywright-{who}", AssumeRolePolicyDocument=trust)
            policy = (REPO / "cluster" / "iam" / f"{who}-policy.json").read_text()
            iam.put_role_policy(RoleName=f"raywright-{who}", PolicyName="raywright", PolicyDocument=policy)
            iam.create_instance_profile(InstanceProfileName=f"raywright-{who}")
            iam.add_role_to_instance_profile(InstanceProfileName=f"raywright-{who}", RoleName=f"raywright-{who}")
        config = bootstrap_aws(prepare_config(copy.deepcopy(cluster_config)))
        provider = AWSNodeProvider(config["provider"], config["cluster_name"])
        for name in WORKER_TYPES:
            tags = {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: name, TAG_RAY_NODE_NAME: name}
            provider.create_node(config["available_node_types"][name]["node_config"], tags, 1)
        ec2 = boto3.client("ec2", region_name=region)
        instances = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
        launched = {
            next(t["Value"] for t in i["Tags"] if t["Key"] == TAG_RAY_USER_NODE_TYPE): i.get("InstanceLifecycle")
            for i in instances
        }
        assert launched == WORKER_TYPES
        for instance in instances:  # workers get the worker profile (the bucket only), and IMDSv2 only
            assert instance["IamInstanceProfile"]["Arn"].endswith("instance-profile/raywright-worker")
            assert instance["MetadataOptions"]["HttpTokens"] == "required"
        assert iam.list_roles()["Roles"] and "ray-autoscaler-v1" not in {
            r["RoleName"] for r in iam.list_roles()["Roles"]
        }  # Ray made no role of its own (its default gives the head EC2 and S3 on every bucket)
        head = config["available_node_types"]["ray.head.default"]["node_config"]
        assert head["IamInstanceProfile"] == {"Name": "raywright-head"}
        assert head["MetadataOptions"]["HttpTokens"] == "required"
        worker_policy = json.loads((REPO / "cluster" / "iam" / "worker-policy.json").read_text())
        resources = {r for statement in worker_policy["Statement"] for r in [statement["Resource"]]}
        assert all("YOUR-BUCKET" in r for r in resources)  # the bucket only: no EC2, no IAM, no other bucket
        (group,) = ec2.describe_security_groups(GroupNames=["raywright-nodes"])["SecurityGroups"]
        from_outside = [rule for rule in group["IpPermissions"] if rule.get("IpRanges")]
        assert [(rule["FromPort"], rule["ToPort"]) for rule in from_outside] == [(22, 22)]


@ray.remote(num_cpus=0, resources={"spot": 1})
class SpotWorker:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class FakeImds(BaseHTTPRequestHandler):
    """EC2's instance metadata service, IMDSv2 only: reads without the session token get 401."""

    token = "fake-session-token"
    notice: dict | None = None
    rebalance: dict | None = None

    def do_PUT(self):
        assert self.path == "/latest/api/token" and self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
        self._reply(200, self.token)

    def do_GET(self):
        if self.headers.get("X-aws-ec2-metadata-token") != self.token:
            return self._reply(401, "")
        answers = {
            "/latest/meta-data/instance-life-cycle": "spot",
            "/latest/meta-data/spot/instance-action": FakeImds.notice and json.dumps(FakeImds.notice),
            "/latest/meta-data/events/recommendations/rebalance": FakeImds.rebalance and json.dumps(FakeImds.rebalance),
        }
        answer = answers.get(self.path)
        if answer:
            return self._reply(200, answer)
        self._reply(404, "")

    def _reply(self, status: int, body: str) -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.mark.cluster
def test_on_cluster_yamls_gpu_nodes_only_work_that_reserved_a_gpu_sees_one(cluster_config, ray_session):
    """Ray 2.60 no longer hides a node's GPUs from the tasks and actors that reserved none: a CPU sweep trial or
    replica placed on a GPU node would use a GPU that a training run there holds. A node started as cluster.yaml
    starts its workers hides them again."""
    setting = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
    exported = re.search(rf"\b{setting}=([^\s;]+)", " ".join(cluster_config["worker_start_ray_commands"]))
    assert exported, f"cluster.yaml's workers start Ray without {setting}"
    node = ray_session.add_node(num_cpus=1, num_gpus=1, resources={"gpu_node": 1}, env_vars={setting: exported[1]})
    try:

        @ray.remote(num_cpus=0, resources={"gpu_node": 0.01})
        def visible_gpus() -> str | None:
            return os.environ.get("CUDA_VISIBLE_DEVICES")

        assert ray.get(visible_gpus.remote(), timeout=60) == ""  # none, where the node's GPU was visible
        assert ray.get(visible_gpus.options(num_gpus=1).remote(), timeout=60) == "0"  # the one it reserved
    finally:
        ray_session.remove_node(node)


@pytest.mark.cluster
def test_the_drainer_waits_out_an_unreachable_metadata_service_checkpoints_on_rebalance_and_drains_on_notice(
    ray_session,
):
    with socket.socket() as sock:  # a port nothing listens on yet: the metadata service is unreachable
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node = ray_session.add_node(num_cpus=1, resources={"spot": 1})
    ray_session.wait_for_nodes()
    # Work on the node, standing in for a training worker: Ray ends an idle node at once when drained.
    worker = SpotWorker.remote()
    ray.get(worker.node_id.remote())
    imds = Imds(f"http://127.0.0.1:{port}", timeout_s=0.5)
    drained, started = [], time.time()

    def drainer():
        assert wait_for_metadata(imds, first_wait_s=0.2, max_wait_s=0.5) == "spot"
        drained.append(watch(imds, node.node_id, 0.1))

    watcher = threading.Thread(target=drainer)
    watcher.start()
    server = None
    try:
        time.sleep(1.5)
        assert watcher.is_alive() and not drained  # still waiting for the metadata service, not dead
        server = ThreadingHTTPServer(("127.0.0.1", port), FakeImds)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        FakeImds.rebalance = {"noticeTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        wait_for_condition(lambda: latest_checkpoint_request("s3://any/run") > started, timeout=20)
        assert watcher.is_alive() and node.node_id not in ray._private.state.state.get_draining_nodes()
        deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=60)
        FakeImds.notice = {"action": "terminate", "time": deadline.strftime("%Y-%m-%dT%H:%M:%SZ")}
        watcher.join(timeout=30)
        assert drained == [True]
        draining = ray._private.state.state.get_draining_nodes()
        assert abs(draining[node.node_id] / 1000 - deadline.timestamp()) < 2
    finally:
        FakeImds.notice = FakeImds.rebalance = None
        if server:
            server.shutdown()
        ray.kill(worker)
        ray_session.remove_node(node)


def _state_api(dashboard: str, listing: str) -> list[dict]:
    request = urllib.request.Request(f"{dashboard}/api/v0/{listing}?detail=1", headers=auth_headers())
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())["data"]["result"]["result"]


def _kinds(resources: list[dict]) -> list[str]:
    return sorted(kind for offered in resources for kind in ("spot", "ondemand") if kind in offered)


def _twin_node_kinds(dashboard: str) -> list[str]:
    """The kind (spot, ondemand) of each alive worker node of the twin, through its state API."""
    return _kinds([node["resources_total"] for node in _state_api(dashboard, "nodes") if node["state"] == "ALIVE"])


def _training_worker_node_kinds(dashboard: str) -> list[str]:
    """The kind of the node under each alive Ray Train worker of the twin."""
    nodes = {node["node_id"]: node["resources_total"] for node in _state_api(dashboard, "nodes")}
    workers = [
        actor for actor in _state_api(dashboard, "actors")
        if actor["class_name"] == "RayTrainWorker" and actor["state"] == "ALIVE"
    ]  # fmt: skip
    return _kinds([nodes[worker["node_id"]] for worker in workers])


def _wait(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.cluster
def test_local_twin_launches_spot_then_on_demand_follows_and_stops_a_job_then_scales_down(
    tiny_dataset, tmp_path, monkeypatch, capsys
):
    """On the fake_multinode twin, through the job CLI: a 2-worker training job asks for two `accelerator`
    nodes; the spot type (max 1) is preferred and exhausted, so an on-demand node is launched too. The
    followed log shows training; `stop` ends the job and the follow; the idle nodes are given back.
    The job's CPU workers take the CPU from the run, not from the nodes' environment (a cloud node's has none)."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # which the twin's nodes would inherit from the tests
    state = local.up(tmp_path / "twin")
    address = ["--address", state.dashboard]
    try:
        assert _twin_node_kinds(state.dashboard) == []  # the head alone: workers scale from zero
        overrides = [
            "scaling.num_workers=2",
            "scaling.resources_per_worker={accelerator: 1}",
            "optim.max_steps=100000",
            f"data.path={tiny_dataset}",
            f"run.storage_path={tmp_path}",
        ]
        sets = [word for item in overrides for word in ("--set", item)]
        submitted = subprocess.run(
            [sys.executable, "-m", "cluster", "submit", "train", "--config", "tiny", *sets, *address],
            cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        job_id = submitted.stdout.split()[1]
        assert f"stop it:   python -m cluster stop {job_id} --address {state.dashboard}\n" in submitted.stdout
        followed, following = tmp_path / "follow.log", [sys.executable, "-m", "cluster", "logs", job_id, "--follow"]
        with open(followed, "w") as out:
            follow = subprocess.Popen([*following, *address], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: "step 10/" in followed.read_text(), 240, "the followed log to show training steps")
            # Where the workers run, not how many nodes are up: once in CI a third node was up at this point
            # (cause unknown; a worker group restart while nodes start launches one). It idles out below.
            assert _training_worker_node_kinds(state.dashboard) == ["ondemand", "spot"], (
                f"nodes up: {_twin_node_kinds(state.dashboard)}; the job's log ends:\n" + followed.read_text()[-4000:]
            )
            # DeepSpeed's warning that it found no GPU, from each worker that chose its device by itself
            assert "unable to detect" not in followed.read_text()
            # Ctrl-C or SIGTERM stops following, not the job.
            log = tmp_path / "follow-interrupted.log"
            interrupt_when([*following, *address], log, lambda: "step " in log.read_text())
            assert f"interrupted: stopped following {job_id}, which goes on (python -m cluster stop {job_id}" in (
                log.read_text()
            )
            assert connect(state.dashboard).get_job_status(job_id).value == "RUNNING"
            assert cluster_main(["stop", job_id, *address]) == 0
            assert follow.wait(timeout=60) == 0  # the follow ends with the job, and says how it ended
        finally:
            follow.kill()
        stopped = f"{job_id}: STOPPED (Job was intentionally stopped.)"
        assert followed.read_text().rstrip().endswith(stopped)
        capsys.readouterr()
        assert cluster_main(["stop", job_id, *address]) == 0  # again: it says the job has ended, and how
        assert capsys.readouterr().out == f"nothing to stop: {job_id} has ended\n{stopped}\n"
        # Each worker's line once: the nodes, sharing the head's logs folder, start no log monitor of their own.
        assert followed.read_text().count("step 10/100000 |") == 1, followed.read_text()[-4000:]
        assert connect(state.dashboard).get_job_status(job_id).value == "STOPPED"
        logs = Path(state.temp_dir, "session_latest", "logs")
        assert "terminated gracefully" in (logs / "jobs" / f"supervisor-{job_id}.log").read_text()  # not SIGKILLed
        # The head and both nodes (and a third node, where one came up) unpacked the job's code in folders of
        # their own, so none deleted the code under another's workers (an agent re-unpacks a working_dir on
        # first use).
        setup = "".join(log.read_text() for log in logs.glob("runtime_env_setup-*.log"))
        assert len(set(re.findall(r"Downloading package from \S+ to \S+/(runtime_resources[^/]*)/", setup))) >= 3
        # A job that fails: the follow of its submit ends with how, and exit code 1 (as `ray job submit`).
        failing = [sys.executable, "-m", "cluster", "submit", "train", "--config", "tiny", "--follow", *address]
        failing += ["--set", "run.storage_path=/proc/raywright"]  # no directory can be made there, even by root
        failed = subprocess.run(failing, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
        assert "config error: run.storage_path: cannot " in failed.stdout
        assert failed.stdout.rstrip().endswith(": FAILED (Job entrypoint command failed with exit code 2)")
        # The stopped run withdrew its autoscaler request: the nodes go after the idle timeout (30 s).
        _wait(lambda: _twin_node_kinds(state.dashboard) == [], 150, "the idle nodes to be given back")
    finally:
        local.down(tmp_path / "twin")
    assert not local._processes_of(state) and not Path(state.temp_dir).exists()


@pytest.mark.unit
def test_down_deletes_no_directory_but_the_one_up_made(tmp_path):
    """A twin's state.json naming another temp dir (edited, or another tool's) is refused; nothing is deleted."""
    precious, state_dir = tmp_path / "precious", tmp_path / "twin"
    precious.mkdir()
    state_dir.mkdir()
    state = {"address": "127.0.0.1:1", "dashboard": "http://127.0.0.1:2", "temp_dir": str(precious)}
    (state_dir / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"state.json is not a local twin's state .*\(temp_dir: not a directory `up`"):
        local.down(state_dir)
    assert precious.exists() and (state_dir / "state.json").exists()


@pytest.mark.unit
def test_the_job_upload_leaves_secrets_and_runs_behind(tmp_path):
    """Ray's own packaging of a working_dir, with the job CLI's excludes: only the project's code goes."""
    from ray._private.runtime_env.packaging import create_package

    from cluster.jobs import EXCLUDES

    project = tmp_path / "project"
    files = [
        "train/loop.py", "README.md", ".env", ".env.local", "sub/.env", ".venv/bin/python", "venv/lib/x.py",
        "deploy.pem", "tls/server.key", ".ray/auth_token", "runs/tiny/metrics.jsonl", "data/mine/manifest.json",
    ]  # fmt: skip
    for name in files:
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("x")
    package = tmp_path / "package.zip"
    create_package(str(project), package, include_gitignore=False, excludes=EXCLUDES)
    uploaded = {name for name in zipfile.ZipFile(package).namelist() if not name.endswith("/")}
    assert uploaded == {"train/loop.py", "README.md"}

"""Shared fixtures: one private Ray per test session, one small prepared corpus, one S3 server."""

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
import torch.distributed as dist
from ray._common.utils import get_default_ray_temp_dir
from ray.cluster_utils import Cluster

from train import checkpoint
from train.config import DataConfig, TrainConfig, load_config
from train.export import save_export
from train.manifest import Manifest, SplitShards, write_manifest
from train.model import GPT
from train.model_config import ModelConfig
from train.process_group import free_port, own_state_api_env
from train.tokenizer import ByteTokenizer

# What the serving tests' model learns by heart: ASCII and 2-, 3- and 4-byte UTF-8 characters.
MEMORIZED_TEXT = "Grüße aus Köln: 3 € für ☕ und 🚀. "


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--failures-at-once",
        action="store_true",
        help="print each failure's report, its captured output included, when it happens rather than at the "
        "session's end, which a GPU lease can cut off (bench/gpu_checks.sh)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed and item.config.getoption("failures_at_once"):
        terminal = item.config.pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\n{report.nodeid} failed in {report.when}:\n{report.longreprtext}")
        for title, content in report.sections:
            terminal.write_line(f"--- {title} ---\n{content[-20000:]}")
    return report


def training_worker_pids() -> list[int]:
    """The processes of the Ray Train workers alive in the session's Ray."""
    from ray.util.state import list_actors

    alive = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return [actor.pid for actor in alive]


REPO = Path(__file__).resolve().parent.parent


def interrupt_when(
    command: list[str], log: Path, ready: Callable[[], bool], signum: int = signal.SIGTERM, env: dict | None = None
) -> None:
    """Run ``command`` (stdout and stderr to ``log``, unbuffered), send it ``signum`` once ``ready()``, and see it
    exit with 130, as a command stopped by Ctrl-C or SIGTERM does."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=out, stderr=out, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        )
        try:
            deadline = time.time() + 300
            while not ready():
                assert process.poll() is None and time.time() < deadline, f"it ended or stalled before {signum}"
                time.sleep(0.02)
            process.send_signal(signum)
            assert process.wait(timeout=120) == 130, log.read_text()[-3000:]
        finally:
            process.kill()


S3_BUCKET = "raywright-test"

# A few standard-library packages: a real corpus of ~4 MB that every machine has.
CORPUS_PACKAGES = ("json", "email", "http", "logging")


class S3Server:
    """moto's S3 server on 127.0.0.1, on a port the OS picks, which a test can take down for a while: its
    buckets live in this process's moto backends, so they outlast a ``stop``."""

    def __init__(self):
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
        self.port = 0
        self.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        self._http = make_server("127.0.0.1", self.port, app, threaded=True, request_handler=MotoRequestHandler)
        self.port = self._http.server_port
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Down: connections are refused, as where storage cannot be reached."""
        self._http.shutdown()
        self._http.server_close()

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """Down inside the block, up again after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server | None]:
    """An S3 server for the session; its endpoint and fake credentials go into the environment, which
    every Ray started later inherits (pyarrow and boto3 both read them). None where moto is not installed
    (a GPU machine given only what the gpu tests need): the tests that use S3 then skip."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        yield None
        return

    server = S3Server()
    os.environ.update(
        AWS_ENDPOINT_URL_S3=server.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One private Ray for the whole session: a head node that elasticity tests add nodes to.

    Its own temp dir and ports, so it never joins (or stops) a Ray already running here. Started after
    the S3 server, so that its workers can reach it.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"  # Ray Train notices a drain within ~1 s
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rwt-")
    # Ray's Cluster also writes the head's address to <default temp dir>/ray_current_cluster, whatever temp_dir
    # the head was given, and fails where that folder is missing (a machine that never ran Ray before).
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    dashboard_port = free_port()
    # Ray's Cluster gives a node no GPU unless told: the gpu tests' runs would wait for one forever.
    gpus = torch.cuda.device_count()
    head = {"num_cpus": 4, "num_gpus": gpus, "temp_dir": temp_dir, "dashboard_port": dashboard_port}
    # The head's processes ask Ray's state API of this Ray, whatever Ray writes its address where `ray start`
    # does later. Only theirs: in this process it would also redirect the job client of the CLI tests.
    with pytest.MonkeyPatch.context() as env:
        for name, value in own_state_api_env(dashboard_port).items():
            env.setenv(name, value)
        cluster = Cluster(initialize_head=True, head_node_args=head)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """``s3://raywright-test`` on the session's S3 server, made for each test that asks for it: moto's
    in-process ``mock_aws`` (tests/test_cluster.py) empties every moto backend when it ends, this
    server's buckets included."""
    if s3_server is None:
        pytest.skip("needs moto, for a local S3 server")
    import boto3

    boto3.client("s3").create_bucket(Bucket=S3_BUCKET)  # a no-op where it exists (us-east-1)
    return f"s3://{S3_BUCKET}"


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in CORPUS_PACKAGES:
        shutil.copytree(stdlib / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="session")
def tiny_dataset(ray_session, corpus_dir, tmp_path_factory) -> str:
    """The corpus prepared for the tiny recipe's sequence length."""
    from train.data import prepare

    out = str(tmp_path_factory.mktemp("datasets") / "tiny")
    prepare(DataConfig(source=f"{corpus_dir}/**/*.py", val_fraction=0.1), out, load_config("tiny").model.seq_len)
    return out


@pytest.fixture
def tiny_config(tiny_dataset, tmp_path):
    """Build a tiny-recipe config on the shared dataset, with a fresh storage path per test."""

    def build(*overrides: str) -> TrainConfig:
        return load_config("tiny", [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", *overrides])

    return build


@pytest.fixture(scope="session")
def process_group():
    """A one-process gloo group, for DeepSpeed engines built in the test process.

    One per session: DeepSpeed keeps the first group it saw, so a second one would not be registered.
    """
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed reads it; Ray Train sets it on real workers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    monkeypatch.undo()


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A filesystem of 10 MiB of its own (tmpfs), for a disk that fills up; skipped where this user cannot mount."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    try:
        mount = ["mount", "-t", "tmpfs", "-o", "size=10M", "tmpfs", disk]
        mounted = subprocess.run(mount, capture_output=True, text=True)
    except FileNotFoundError:  # no mount command
        pytest.skip("cannot mount a tmpfs here: no mount command")
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "--lazy", disk], check=True)


def fill(disk: Path, room: int = 0) -> Path:
    """Fill ``disk`` with a file of its own but for ``room`` bytes; deleted, it gives the space back."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                f.write(b"\0" * 4096)
    os.truncate(filler, filler.stat().st_size - room)
    return filler


def run_record(cfg: TrainConfig, world_size: int = 1) -> checkpoint.RunRecord:
    """What a run of ``cfg`` on ``world_size`` workers records in a checkpoint of step 0 (its dataset made up)."""
    return checkpoint.RunRecord(
        world_size=world_size,
        global_batch_size=cfg.optim.global_batch_size,
        samples_seen=0,
        reason="steps",
        config=cfg.to_dict(),
        tokenizer=ByteTokenizer().spec(),
        data_manifest_sha256="0" * 64,
    )


# The shards of ``a_manifest``'s dataset and the sequences each holds, by split.
A_DATASETS_SHARD_ROWS = {"train": {"train/0.parquet": 200, "train/1.parquet": 83}, "val": {"val/0.parquet": 7}}


def a_manifest() -> Manifest:
    """The manifest of a dataset of the tiny recipe's sequence length: 200 + 83 train and 7 val sequences."""
    splits = {
        split: SplitShards(shards=list(rows), sequences=sum(rows.values()))
        for split, rows in A_DATASETS_SHARD_ROWS.items()
    }
    return Manifest(
        source="corpus/**/*.txt",
        source_sha256="ab" * 32,
        documents=40,
        val_fraction=0.02,
        tokenizer=ByteTokenizer().spec(),
        tokens_per_byte=1.0010673782521682,
        seq_len=128,
        **splits,
    )


def write_a_prepared_dataset(path: Path) -> Manifest:
    """``a_manifest``'s dataset at ``path``, without Ray: its shards (zero tokens, as ``prepare`` types them), then
    the manifest."""
    manifest = a_manifest()
    row = pa.list_(pa.uint16(), manifest.seq_len + 1)
    for shard, rows in (item for split in A_DATASETS_SHARD_ROWS.values() for item in split.items()):
        (path / shard).parent.mkdir(parents=True, exist_ok=True)
        tokens = pa.array(np.zeros((rows, manifest.seq_len + 1), np.uint16).tolist(), row)
        pq.write_table(pa.table({"tokens": tokens}), path / shard)
    write_manifest(str(path), manifest)
    return manifest


def metadata_json(step: int, files: dict[str, int]) -> dict:
    """``metadata.json`` of a checkpoint of the tiny recipe at ``step`` that lists ``files``."""
    record = run_record(load_config("tiny")).model_dump()
    return checkpoint.CheckpointMetadata(**record, step=step, time=0.0, files=files).model_dump()


def on_ranks(target, world: int, *args) -> dict:
    """Run ``target(rank, world, port, results, *args)`` in ``world`` new processes joined by gloo at ``port``;
    the ``results`` they set. Nothing is forked: a fork of this process, a Ray driver, shares its connections."""
    with torch.multiprocessing.get_context("spawn").Manager() as manager:  # its process ends with the call
        results = manager.dict()
        torch.multiprocessing.spawn(target, args=(world, free_port(), results, *args), nprocs=world)
        return dict(results)


@pytest.fixture(scope="session")
def memorized_export(tmp_path_factory) -> str:
    """A small GPT trained in-process (seconds) to recite MEMORIZED_TEXT, saved as a training export.

    Its greedy continuations are known text with multi-byte characters, which makes serving
    results checkable; training itself is tested elsewhere.
    """
    torch.manual_seed(0)
    cfg = ModelConfig(seq_len=96, n_layer=2, n_head=2, d_model=64)
    model = GPT(cfg)
    tokens = torch.from_numpy(ByteTokenizer().encode(MEMORIZED_TEXT * 12).astype("int64"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (16,))
        window = torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts])
        _, loss = model(window[:, :-1], window[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"the serving test model did not learn its text (loss {loss.item():.3f})"
    out = str(tmp_path_factory.mktemp("models") / "memorized")  # served under its directory's name
    save_export(model.state_dict(), cfg, ByteTokenizer(), out, provenance=None)
    return out

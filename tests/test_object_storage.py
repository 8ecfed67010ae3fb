"""The whole path on object storage (a moto S3 server on 127.0.0.1), as a user runs it: a corpus in a bucket
is prepared there, trained on 2 workers with checkpoints in the bucket, the driver is killed outright, the
run is resumed on 1 worker from the bucket, exported to it, and served from ``s3://``."""

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import requests
from ray import serve
from ray._common.test_utils import wait_for_condition

from serve.app import build_app
from tests.conftest import training_worker_pids
from train import checkpoint, storage
from train.export import load_exported
from train.lease import LEASE
from train.metrics import METRICS, TENSORBOARD, read_metrics
from train.process_group import free_port
from train.timeline import read_summary

pytestmark = pytest.mark.cluster

MAX_STEPS = 12


def _train_command(root: str, address: str, workers: int) -> list[str]:
    settings = {
        "run.ray_address": address,
        "run.storage_path": f"{root}/runs",
        "run.name": "on-s3",
        "run.log_every": 2,
        "run.eval_every": 6,
        "run.eval_samples": 16,
        "data.source": f"{root}/corpus/**/*.py",
        "data.tokenizer": "byte",
        "data.val_fraction": 0.2,
        "scaling.num_workers": workers,
        "optim.max_steps": MAX_STEPS,
        "checkpoint.every_steps": 4,
        "checkpoint.keep_last": 1,
    }
    return [
        sys.executable,
        "-m",
        "train",
        *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")],
    ]


def _checkpoint_reported(run_uri: str) -> bool:
    return any("checkpoint" in m for m in read_metrics(run_uri))


def test_a_run_in_a_bucket_survives_its_driver_killed_resumes_at_another_size_and_serves_from_it(
    ray_session, s3_bucket, tmp_path
):
    root = f"{s3_bucket}/e2e-{time.time_ns()}"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email"):
        for source in sorted((stdlib / package).glob("*.py")):
            storage.write_bytes(f"{root}/corpus/{package}/{source.name}", source.read_bytes())
    run_uri = f"{root}/runs/on-s3"
    env = {**os.environ, "RAY_ADDRESS": ""}

    # 1. Prepare and train on 2 workers; kill the driver (SIGKILL: no cleanup) once a checkpoint is complete
    # and reported (its report uploads the metrics so far).
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            _train_command(root, ray_session.address, 2), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 300
        while not _checkpoint_reported(run_uri) and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Its workers outlive it until Ray ends the dead driver's actors, and once finished a checkpoint meanwhile (the
    # export below then took that one): the newest complete checkpoint is known once they are gone.
    wait_for_condition(lambda: not training_worker_pids(), timeout=60)
    killed_at = checkpoint.latest_complete(run_uri)
    assert killed_at is not None and killed_at.world_size == 2, (tmp_path / "first.log").read_text()[-3000:]
    assert killed_at.step < MAX_STEPS
    assert storage.read_json(f"{run_uri}/{LEASE}")["pid"] == first.pid  # it died holding the run

    # Its checkpoint exported from the bucket: the 2 workers' shards converted in a scratch folder, the run only read.
    export_command = [sys.executable, "-m", "train.export_checkpoint", run_uri]
    exported = subprocess.run(export_command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    step_export = load_exported(f"{run_uri}/exports/{os.path.basename(killed_at.uri)}")
    assert step_export.provenance.checkpoint == killed_at.uri and step_export.name == "on-s3"
    assert not storage.exists(f"{killed_at.uri}/{checkpoint.UNIVERSAL}")

    # 2. Resubmitted on 1 worker: takes the dead driver's lease, converts the 2-worker checkpoint, finishes.
    downloads = Path(checkpoint.download_dir(killed_at.uri)).parent
    downloaded_before = set(downloads.iterdir()) if downloads.exists() else set()
    second = subprocess.run(
        _train_command(root, ray_session.address, 1), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    assert "taking over the run from a driver that is gone" in output
    assert f"resumed from {killed_at.uri} at step {killed_at.step} on 1 workers, converted from 2" in output
    final = checkpoint.latest_complete(run_uri)
    assert (final.step, final.world_size) == (MAX_STEPS, 1)
    assert storage.list_dir(f"{run_uri}/{checkpoint.CHECKPOINTS}") == [os.path.basename(final.uri)]  # keep_last 1
    assert set(downloads.iterdir()) == downloaded_before  # the node's download of it, removed once loaded

    # Side files are in the bucket, both drivers' reports in one metrics file; nothing is left on the driver's disk.
    steps = [m["step"] for m in read_metrics(run_uri) if "loss" in m]
    assert steps[0] == 1 and steps[-1] == MAX_STEPS and len(steps) > MAX_STEPS // 2
    # One record of both drivers' training: the killed one's attempt, then the restart at 1 worker.
    elastic = read_summary(run_uri)
    assert [(r.from_workers, r.to_workers, r.reason) for r in elastic.resizes] == [(2, 1, "driver lost")], elastic
    assert elastic.restarts == 1 and elastic.world_size_timeline[1].from_step == killed_at.step
    assert "resize 2 -> 1 workers (driver lost): " in output and elastic.resizes[0].driver_gone_s > 0
    assert 0 < elastic.step_s < elastic.wall_s
    assert not storage.exists(f"{run_uri}/{LEASE}")  # released at the end
    assert not (tmp_path / "runs").exists()
    for side_file in (METRICS, TENSORBOARD):  # the node-local copies the recorder uploaded them from
        assert not os.path.exists(storage.node_local_dir("run-files", f"{run_uri}/{side_file}")), side_file
    assert not os.path.exists(checkpoint.staging_root(run_uri))  # where the workers staged their shards to upload

    # 3. Served from the bucket.
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"checkpoint": f"{run_uri}/export", "cpus_per_replica": 0.25}), name="s3", route_prefix="/")
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "import json", "max_tokens": 8}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "on-s3"
    finally:
        serve.shutdown()

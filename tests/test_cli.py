"""Every CLI answers bad input with exit code 2 and one line on stderr that names the key; never a traceback.

The cases run as real subprocesses, a few at a time, before the tests that check them (about a minute:
not in the quick ``-m unit`` loop).
"""

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from tests.conftest import REPO, metadata_json, write_a_prepared_dataset
from train.config import load_config
from train.hf_gpt2 import hf_config
from train.model_config import ModelConfig
from train.tokenizer import ByteTokenizer

# (command, what its one line must name); {tmp} is a per-session directory with the files below, {busy} a port
# that something listens on.
CASES = [
    ("train --set optim.lrr=1", "unknown key optim.lrr"),
    ("train --set x=[", "override 'x=['"),
    ("train --config {tmp}/malformed.yaml", "not valid YAML at line"),
    ("train --config nosuch", "--config: no recipe 'nosuch'"),
    ("train --config {tmp}/broken.json", "broken.json is not a YAML file"),
    ("train --set model.n_head=0", "model.n_head"),
    ("train --set optim.lr=.nan", "optim.lr"),
    ("train --set run.name=..", "run.name"),
    ("train --set run.eval_samples=0", "run.eval_samples"),
    ("train --set deepspeed.config_file={tmp}/no-such.json", "deepspeed.config_file"),
    ("train --set deepspeed.config_file={tmp}/broken.json", "deepspeed.config_file"),
    ("train --set deepspeed.config_file={tmp}/batch.json", "deepspeed.config_file"),
    ("train --config small", "scaling.use_gpu"),  # a laptop has no GPU and a local Ray cannot add one
    ("train --set data.source={tmp}/no-such-corpus", "data.source"),
    ("train --set data.path={tmp}/users-own", "data.path"),
    ("train --set data.path={tmp}/damaged", "damaged/manifest.json is not a manifest this raywright reads (source:"),
    ("train --set data.path={tmp}/cut-shard", "cut-shard/train/1.parquet: a shard of the prepared dataset that cannot"),
    ("train --set run.storage_path=s3://raywright-no-such-bucket/runs", "run.storage_path"),
    # In ~20 s, not the 15 minutes that GCS's client retries by default.
    (
        "train --set 'run.storage_path=gs://raywright-no-such-bucket/runs?endpoint_override=127.0.0.1:9&scheme=http'",
        "run.storage_path: cannot use gs://",
    ),
    ("train --set run.storage_path={tmp}/resumed --set model.n_layer=3", "model.n_layer 2 -> 3"),
    ("train --set run.storage_path={tmp}/edited", "step_00000004/metadata.json is not checkpoint metadata this raywr"),
    ("train --set run.storage_path={tmp}/edited-record", "tiny/timeline.json is not a run timeline this raywright"),
    ("train --set run.storage_path={tmp}/owned", f"being trained by another driver (pid {os.getpid()}"),
    ("train --bogus", "unrecognized arguments: --bogus"),
    # No directory can be made there, though root may write to /proc (a user may not: refused before the write).
    ("train --set run.storage_path=/proc/raywright", "run.storage_path: cannot "),
    ("tune", "give one of --config and --resume"),
    ("tune --config nosuch", "--config: no sweep 'nosuch'"),
    ("tune --config tiny --set name=a/b", "name"),
    ("tune --config tiny --set num_trials=0", "num_trials"),
    ("tune --config tiny --set storage_path=s3://raywright-no-such-bucket/runs", "storage_path: cannot use s3://"),
    ("tune --config tiny --set 'space={optim.lrate: {choice: [1]}}'", "optim.lrate"),
    ("tune --resume {tmp}", "--resume"),
    ("tune --config tiny --set best_recipe_path={tmp}", "is a directory; give the path of a YAML file"),
    ("tune --config tiny --set best_recipe_path={tmp}/users-own/notes.txt", "notes.txt is a file that no sweep wrote"),
    ("tune --resume {tmp} --set num_trials=3", "--set: a resumed sweep keeps the settings it started with"),
    ("serve", "checkpoint"),
    ("serve --checkpoint {tmp}/no-such-export", "checkpoint"),
    ("serve --checkpoint s3://raywright-no-such-bucket/runs/tiny", "checkpoint: cannot read s3://raywright-no-such"),
    ("serve --checkpoint {tmp}/resumed/tiny", "export one of its checkpoints first (python -m train.export_checkpoint"),
    ("serve --checkpoint {tmp}/stale-record", "stale-record/raywright.json is not a training record this raywright r"),
    ("serve --checkpoint {tmp}/cut-weights", "cut-weights/model.safetensors: 70 bytes, where its header describes 80"),
    ("serve --checkpoint {tmp}/no-tokenizer", "checkpoint: no tokenizer.json at"),
    ("serve --checkpoint {tmp}/model --set device=cpu --set precision=fp8", "precision 'fp8' needs a GPU"),
    ("serve --checkpoint {tmp}/model --set api_key_file={tmp}/no-such-key", "api_key_file: cannot read"),
    # A local Ray's replica would wait forever for a GPU.
    *([] if torch.cuda.is_available() else [("serve --checkpoint {tmp}/model --set device=cuda", "device: cuda, but")]),
    ("serve --checkpoint x --set precision=int4", "precision"),
    ("serve --checkpoint x --set api_key=s3cret", "unknown key api_key"),
    ("serve --checkpoint x --port 70000", "argument --port: '70000' is not a TCP port"),
    ("serve --checkpoint x --port {busy}", "is in use (another server?)"),
    ("train.export_checkpoint {tmp}/no-such-run", "holds no complete checkpoint"),
    ("train.export_checkpoint s3://raywright-no-such-bucket/runs/tiny", "location: cannot read s3://raywright-no-such"),
    ("train.export_checkpoint {tmp}/resumed/tiny --step 3", "no checkpoint of step 3 (it has ['step_00000004'])"),
    ("train.export_checkpoint {tmp}/resumed/tiny --out {tmp}/users-own", "--out"),
    ("train.export_checkpoint {tmp}/edited/tiny", "004/metadata.json is not checkpoint metadata this raywright reads"),
    ("train.data prepare --out {tmp}/prepared --seq-len 0", "argument --seq-len: must be greater than or equal to 1"),
    ("train.data prepare --out {tmp}/prepared --val-fraction 0.5", "argument --val-fraction: must be less than 0.5"),
    ("train.data prepare --out {tmp}/prepared --tokenizer bpe --vocab-size 70000", "argument --vocab-size"),
    ("train.data prepare --out {tmp}/prepared --tokenizer {tmp}/no-such-tokenizer", "--tokenizer: no tokenizer.json"),
    ("train.data prepare --source {tmp}/no-such-corpus --out {tmp}/prepared", "data.source: cannot read"),
    ("train.data prepare --out {tmp}/users-own", "users-own holds files that are not a prepared dataset"),
    ("train.data prepare --out s3://raywright-no-such-bucket/prepared", "--out: cannot use s3://raywright-no-such"),
    ("cluster submit train --config tiny --set optim.lr=x", "optim.lr"),
    ("cluster submit tune --config nosuch", "--config"),
    ("cluster submit train --config tiny --env FOO", "--env"),
    ("cluster submit nosuch --config tiny", "invalid choice: 'nosuch'"),
    ("cluster up", "--local"),
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "malformed.yaml").write_text("optim: {lr: 1e-3\n")
    (tmp / "broken.json").write_text('{"zero_optimization": ')
    (tmp / "batch.json").write_text(json.dumps({"train_batch_size": 999}))
    step = tmp / "resumed" / "tiny" / "checkpoints" / "step_00000004"  # a complete checkpoint of no files
    step.mkdir(parents=True)
    (step / "metadata.json").write_text(json.dumps(metadata_json(4, files={})))
    edited = tmp / "edited" / "tiny" / "checkpoints" / "step_00000004"  # its metadata edited by hand
    edited.mkdir(parents=True)
    (edited / "metadata.json").write_text(json.dumps({**metadata_json(4, files={}), "world_size": "2"}))
    (tmp / "edited-record" / "tiny").mkdir(parents=True)  # a run whose timeline was edited by hand
    (tmp / "edited-record" / "tiny" / "timeline.json").write_text(json.dumps({"attempts": [{"world_size": "2"}]}))
    (tmp / "stale-record").mkdir()  # a model whose training record this version cannot read
    (tmp / "stale-record" / "config.json").write_text("{}")
    (tmp / "stale-record" / "raywright.json").write_text(json.dumps({"provenance": {"data_manifest_sha256": "0"}}))
    weights = safetensors.numpy.save({"w": np.zeros(4, np.float32)})  # whole, as far as the checks before Ray see
    assert len(weights) == 80
    # A GPT-2 directory; one whose weights a copy cut short; one without its tokenizer.
    for model, size, tokenizer in (("model", 80, True), ("cut-weights", 70, True), ("no-tokenizer", 80, False)):
        (tmp / model).mkdir()
        (tmp / model / "config.json").write_text(json.dumps(hf_config(ModelConfig(), eot_id=256)))
        (tmp / model / "model.safetensors").write_bytes(weights[:size])
        if tokenizer:
            (tmp / model / "tokenizer.json").write_text(ByteTokenizer().to_json())
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "token": "live", "heartbeat": time.time() + 600}
    (tmp / "owned" / "tiny").mkdir(parents=True)
    (tmp / "owned" / "tiny" / "lease.json").write_text(json.dumps(owner))  # a live driver of run "tiny"
    (tmp / "damaged").mkdir()  # a manifest edited by hand
    (tmp / "damaged" / "manifest.json").write_text(json.dumps({"seq_len": 128, "train": {"sequences": 283}}))
    cut = write_a_prepared_dataset(tmp / "cut-shard").train.shards[1]  # cut short since it was prepared
    (tmp / "cut-shard" / cut).write_bytes((tmp / "cut-shard" / cut).read_bytes()[:100])
    (tmp / "users-own").mkdir()
    (tmp / "users-own" / "notes.txt").write_text("mine")
    # Object storage that cannot be reached (a closed port) and no instance metadata to ask for credentials.
    env = {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true", "RAY_ADDRESS": ""}

    busy = socket.create_server(("127.0.0.1", 0))

    def run(command: str) -> subprocess.CompletedProcess:
        command = command.replace("{tmp}", str(tmp)).replace("{busy}", str(busy.getsockname()[1]))
        return subprocess.run(
            [sys.executable, "-m", *shlex.split(command)],
            cwd=tmp,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    with busy, ThreadPoolExecutor(4) as pool:
        done = dict(zip([c for c, _ in CASES], pool.map(run, [c for c, _ in CASES]), strict=True))
    assert (tmp / "users-own" / "notes.txt").read_text() == "mine"  # a refused data.path is left as it was
    assert not (tmp / "runs").exists() and not (tmp / "prepared").exists()  # a rejected run writes nothing
    assert [p.name for p in (tmp / "resumed").iterdir()] == ["tiny"]
    assert [p.name for p in edited.iterdir()] == ["metadata.json"]  # a checkpoint it cannot read is left as it was
    assert [p.name for p in (tmp / "edited-record" / "tiny").iterdir()] == ["timeline.json"]
    return done


@pytest.mark.parametrize(("command", "named"), CASES, ids=[c for c, _ in CASES])
def test_bad_input_is_one_line_naming_the_key_and_exit_2(answers, command, named):
    answer = answers[command]
    lines = answer.stderr.strip().splitlines()
    assert answer.returncode == 2, answer.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in answer.stderr, answer.stderr[-2000:]
    assert named in lines[0]


@pytest.mark.unit
@pytest.mark.parametrize("cli", ["train", "tune", "serve", "cluster"])
def test_help_documents_the_settings(cli):
    text = subprocess.run(
        [sys.executable, "-m", cli, *(["submit"] if cli == "cluster" else []), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    expected = {
        "train": ["optim.lr  (float, default 0.001)", "Peak learning rate", "deepspeed.zero_stage  (0|1|2|3"],
        "tune": ["space  (dict[str, dict[str, Any]], required)", "grace_period  (int, default 20)"],
        "serve": ["precision  (auto|fp32|bf16|int8|fp8, default auto)", "api_key_file"],
        "cluster": ["python -m train --help"],
    }[cli]
    for fragment in expected:
        assert fragment in text, fragment


# A CLI's bad setting, what its one line names, and a --print-config that works.
QUICK_ANSWERS = {
    "train": (["--set", "optim.lrr=1"], "unknown key optim.lrr", ["--print-config"]),
    "tune": (["--resume", "/nonexistent/sweep"], "holds no sweep.yaml", ["--config", "tiny", "--print-config"]),
    # After a valid config, the checkpoint's path: no model there is answered as quickly.
    "serve": (["--checkpoint", "/nonexistent/run"], "no config.json", ["--checkpoint", "x", "--print-config"]),
}


@pytest.mark.unit
@pytest.mark.parametrize("cli", sorted(QUICK_ANSWERS))
def test_config_errors_help_and_print_config_load_no_torch_deepspeed_or_ray(cli):
    """Importing those takes seconds; a config error, --help and --print-config need none of them."""
    bad, named, print_config = QUICK_ANSWERS[cli]
    code = (
        "import contextlib, io, sys\n"
        f"from {cli}.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main({bad!r}) == 2 and main({print_config!r}) == 0\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        main(['--help'])\n"
        "print(sorted(set(sys.modules) & {'torch', 'deepspeed', 'ray'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and "config error: " in done.stderr, done.stderr[-2000:]
    assert named in done.stderr and done.stdout.splitlines()[-1] == "[]"


def test_a_failing_ray_start_is_one_line_with_its_reason(tmp_path):
    """`cluster up --local` where `ray` cannot start: its reason on one line, exit 1, no state left behind."""
    env = {**os.environ, "HOME": str(tmp_path), "PATH": str(tmp_path)}  # no `ray` executable on PATH
    twin_temp_dirs = set(Path("/tmp").glob("rwtwin-*"))
    done = subprocess.run(
        [sys.executable, "-m", "cluster", "up", "--local"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "error: cannot run `ray start`: No such file or directory (is Ray installed in this environment?)"
    ]
    assert not (tmp_path / ".raywright" / "local-cluster" / "state.json").exists()
    assert set(Path("/tmp").glob("rwtwin-*")) == twin_temp_dirs


@pytest.mark.cluster
def test_on_a_cluster_the_run_says_what_it_waits_for(ray_session, capsys):
    from train.launch import say_what_the_cluster_lacks

    say_what_the_cluster_lacks(load_config("tiny", ["scaling.resources_per_worker={accelerator: 1}"]))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("waiting for the cluster to add nodes offering {'accelerator': 1.0} per worker")
    say_what_the_cluster_lacks(load_config("tiny"))  # CPUs the session's head has: nothing to wait for
    assert capsys.readouterr().err == ""


def test_serve_refuses_haproxy_on_a_running_ray(monkeypatch, capsys):
    """Serve's ingress is read when Ray starts: on a Ray that runs already, the flag could not take effect."""
    from serve.__main__ import main

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main(["--checkpoint", "anything", "--ingress", "haproxy"]) == 2
    assert "--ingress haproxy: a running Ray's ingress is set when it starts" in capsys.readouterr().err

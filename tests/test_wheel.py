"""A wheel built from the repo carries its recipes and trains the tiny recipe from outside the checkout."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent


def test_a_wheel_trains_the_tiny_recipe_outside_the_checkout(tiny_dataset, tmp_path):
    source = tmp_path / "source"  # built from a copy: setuptools writes build/ beside the sources
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".git", "runs", "data", "build", "*.egg-info", "__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("raywright-*.whl")
    # The venv sees this machine's torch, Ray and DeepSpeed, and raywright only from the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", wheel], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "PYTHONPATH")}
    where = subprocess.run(
        [python, "-c", "import train.config as c; print(c.__file__, c.recipe_names())"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(venv) in where and "'tiny'" in where, where  # not the checkout's editable install
    steps = ["optim.max_steps=4", "optim.warmup_steps=2", "run.eval_every=4", f"data.path={tiny_dataset}"]
    trained = subprocess.run(
        [python, "-m", "train", "--config", "tiny", *[a for s in steps for a in ("--set", s)]],
        cwd=elsewhere,
        env=env,  # no RAY_ADDRESS: a private Ray, whose workers run the venv's Python
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "steps: 4" in trained.stdout and "bits/byte: " in trained.stdout
    assert (elsewhere / "runs" / "tiny" / "export" / "model.safetensors").is_file()

"""Shared fixtures: one private Ray per test session and one small prepared corpus."""

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import pytest
import ray

from train.config import TrainConfig, load_config

# A few standard-library packages: a real corpus of ~4 MB that every machine has.
CORPUS_PACKAGES = ("json", "email", "http", "logging")


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray (own temp dir, never one already running on this machine)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rwt-")
    ray.init(address="local", num_cpus=4, _temp_dir=temp_dir, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


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
    prepare(f"{corpus_dir}/**/*.py", out, seq_len=load_config("tiny").model.seq_len, val_fraction=0.1)
    return out


@pytest.fixture
def tiny_config(tiny_dataset, tmp_path):
    """Build a tiny-recipe config on the shared dataset, with a fresh storage path per test."""

    def build(*overrides: str) -> TrainConfig:
        return load_config("tiny", [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", *overrides])

    return build

"""Sharded DeepSpeed checkpoints in the run's storage, complete or ignored.

Layout: ``<run>/checkpoints/step_00000120/`` holds DeepSpeed's shards and, written last
by rank 0 once every rank has finished, ``metadata.json``: the step, samples seen, world
size, global batch, config, tokenizer and the size of every shard file. A checkpoint
counts only when its metadata exists and every file it lists is there at that size; a
half-written one is skipped with a warning, so a crash mid-save never becomes "latest".
"""

import hashlib
import logging
import os
import shutil
import tempfile
import time
from typing import Any

import pyarrow.fs as pafs
import torch.distributed as dist

from train import storage

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
METADATA = "metadata.json"


def checkpoint_uri(run_uri: str, step: int) -> str:
    return storage.join(run_uri, CHECKPOINTS, f"step_{step:08d}")


def _file_sizes(uri: str) -> dict[str, int]:
    fs, root = storage.resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {os.path.relpath(i.path, root): i.size for i in infos if i.type == pafs.FileType.File}


def _incompleteness(uri: str) -> str | None:
    """Why the checkpoint at ``uri`` is incomplete, or None if it is complete."""
    if not storage.exists(storage.join(uri, METADATA)):
        return f"no {METADATA}"
    expected = storage.read_json(storage.join(uri, METADATA))["files"]
    present = _file_sizes(uri)
    for name, size in expected.items():
        if present.get(name) != size:
            return f"{name} is missing or has {present.get(name)} bytes instead of {size}"
    return None


def _step_dirs(run_uri: str) -> list[str]:
    """URIs of the run's checkpoint directories, oldest first (DeepSpeed also leaves scripts there)."""
    root = storage.join(run_uri, CHECKPOINTS)
    return [storage.join(root, name) for name in storage.list_dir(root) if name.startswith("step_")]


def latest_complete(run_uri: str) -> dict[str, Any] | None:
    """Metadata (with its ``uri``) of the newest complete checkpoint of a run, or None."""
    for uri in reversed(_step_dirs(run_uri)):
        reason = _incompleteness(uri)
        if reason is None:
            return {**storage.read_json(storage.join(uri, METADATA)), "uri": uri}
        logger.warning("skipping incomplete checkpoint %s: %s", uri, reason)
    return None


def save(engine, run_uri: str, step: int, metadata: dict[str, Any], keep_last: int) -> str:
    """Save a checkpoint from every rank (a collective call); returns its URI."""
    uri = checkpoint_uri(run_uri, step)
    tag = os.path.basename(uri)
    if storage.is_local(run_uri):
        engine.save_checkpoint(storage.resolve(os.path.dirname(uri))[1], tag=tag, save_latest=False)
    else:  # each rank stages its own shards locally, then uploads them
        with tempfile.TemporaryDirectory(prefix="raywright-ckpt-") as staging:
            engine.save_checkpoint(staging, tag=tag, save_latest=False)
            storage.copy_dir(os.path.join(staging, tag), uri)
    dist.barrier()  # every shard is in place before the metadata says so
    if dist.get_rank() == 0:
        files = _file_sizes(uri)
        storage.write_json(storage.join(uri, METADATA), {**metadata, "step": step, "files": files, "time": time.time()})
        _prune(run_uri, keep_last)
    dist.barrier()
    return uri


def _prune(run_uri: str, keep_last: int) -> None:
    for uri in _step_dirs(run_uri)[:-keep_last]:
        storage.delete_dir(uri)


def load(engine, checkpoint: dict[str, Any]) -> None:
    """Load model and optimizer state on every rank (a collective call)."""
    uri = checkpoint["uri"]
    tag = os.path.basename(uri)
    if storage.is_local(uri):
        local_root = os.path.dirname(storage.resolve(uri)[1])
    else:  # one download per node, by its first local rank
        local_root = os.path.join(
            tempfile.gettempdir(), "raywright-ckpt", hashlib.sha256(uri.encode()).hexdigest()[:16]
        )
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(local_root, ignore_errors=True)
            storage.copy_dir(uri, os.path.join(local_root, tag))
        dist.barrier()
    load_path, _ = engine.load_checkpoint(local_root, tag=tag, load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {uri}")

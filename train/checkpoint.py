"""Sharded DeepSpeed checkpoints in the run's storage, complete or ignored.

Layout: ``<run>/checkpoints/step_00000120/`` holds DeepSpeed's shards and, written last
by rank 0 once every rank has finished, ``metadata.json``: the step, samples seen, world
size, global batch, config, tokenizer and the size of every file, ``tokenizer.json`` included. A checkpoint
counts only when its metadata exists and every file it lists is there at that size; a
half-written one is skipped with a warning, so a crash mid-save never becomes "latest".
"""

import argparse
import contextlib
import hashlib
import io
import logging
import os
import shutil
import tempfile
import time
from typing import Any

import pyarrow.fs as pafs
import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal

from train import storage
from train.tokenizer import BPETokenizer, save_tokenizer

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
METADATA = "metadata.json"
UNIVERSAL = "universal"


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


def save(engine, run_uri: str, step: int, metadata: dict[str, Any], keep_last: int, tokenizer: BPETokenizer) -> str:
    """Save a checkpoint, with its tokenizer, from every rank (a collective call); returns its URI.

    The step directory is written fresh (what an earlier, interrupted attempt left there is cleared
    first) and counts only once rank 0 has written ``metadata.json`` listing every file's size.
    """
    uri = checkpoint_uri(run_uri, step)
    tag = os.path.basename(uri)
    if dist.get_rank() == 0 and storage.exists(uri):
        storage.delete_dir(uri)  # shards of another world size must not be listed, or converted, as this one's
    dist.barrier()
    if storage.is_local(run_uri):
        engine.save_checkpoint(storage.resolve(os.path.dirname(uri))[1], tag=tag, save_latest=False)
    else:  # each rank stages its own shards locally, then uploads them
        with tempfile.TemporaryDirectory(prefix="raywright-ckpt-") as staging:
            engine.save_checkpoint(staging, tag=tag, save_latest=False)
            storage.copy_dir(os.path.join(staging, tag), uri)
    dist.barrier()  # every shard is in place before the metadata says so
    if dist.get_rank() == 0:
        save_tokenizer(tokenizer, uri)
        files = _file_sizes(uri)
        storage.write_json(storage.join(uri, METADATA), {**metadata, "step": step, "files": files, "time": time.time()})
        prune(run_uri, keep_last)
    dist.barrier()
    return uri


def prune(run_uri: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; delete older ones and every incomplete one.

    Called right after a save completes, when no other save is in flight: an incomplete directory is
    then an interrupted attempt, never one still being written, and never counts toward ``keep_last``.
    """
    step_dirs = _step_dirs(run_uri)
    complete = [uri for uri in step_dirs if _incompleteness(uri) is None]
    kept = set(complete[-keep_last:])
    for uri in step_dirs:
        if uri not in kept:
            storage.delete_dir(uri)


def _local_dir(uri: str) -> str:
    """A local directory holding the checkpoint at ``uri``: itself, or a per-node download (a collective)."""
    if storage.is_local(uri):
        return storage.resolve(uri)[1]
    local = os.path.join(tempfile.gettempdir(), "raywright-ckpt", hashlib.sha256(uri.encode()).hexdigest()[:16])
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one download per node
        shutil.rmtree(local, ignore_errors=True)
        storage.copy_dir(uri, local)
    dist.barrier()
    return local


def needs_universal(checkpoint: dict[str, Any], world_size: int) -> bool:
    """DeepSpeed refuses a sharded checkpoint from another data-parallel size; universal format does not."""
    return checkpoint["world_size"] != world_size


def convert_to_universal(checkpoint: dict[str, Any]) -> None:
    """Rank 0 converts the checkpoint to DeepSpeed's universal format, once; the others wait.

    The result lives inside the checkpoint (``<ckpt>/universal/``), so it is pruned with it,
    and counts only once ``universal/done.json`` is written.
    """
    uri = checkpoint["uri"]
    done = storage.join(uri, UNIVERSAL, "done.json")
    if dist.get_rank() == 0 and not storage.exists(done):
        started = time.time()
        stage = checkpoint["config"]["deepspeed"]["zero_stage"]
        with tempfile.TemporaryDirectory(prefix="raywright-universal-") as scratch:
            source = storage.resolve(uri)[1] if storage.is_local(uri) else os.path.join(scratch, "source")
            if not storage.is_local(uri):
                storage.copy_dir(uri, source)
            output = os.path.join(scratch, UNIVERSAL)
            _run_ds_to_universal(source, output, inject_missing_state=stage < 3)
            target = storage.join(uri, UNIVERSAL)
            if storage.exists(target):
                storage.delete_dir(target)  # a conversion cut short earlier: redone, never loaded
            if storage.is_local(uri):  # staged beside its place and renamed, so it appears whole
                staged = f"{target}.{os.getpid()}.tmp"
                storage.copy_dir(output, staged)
                os.replace(storage.resolve(staged)[1], storage.resolve(target)[1])
            else:
                storage.copy_dir(output, target)
        storage.write_json(done, {"seconds": time.time() - started})  # last: the conversion counts from here
        logger.info("converted %s to universal format in %.1f s", uri, time.time() - started)
    dist.barrier()


def _run_ds_to_universal(source: str, output: str, inject_missing_state: bool) -> None:
    """DeepSpeed's converter, in this process (a subprocess would spend seconds re-importing torch)."""
    converter_args = argparse.Namespace(
        input_folder=source,
        output_folder=output,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=inject_missing_state,  # ZeRO-1/2 checkpoints lack state it expects
    )
    chatter = io.StringIO()  # it prints progress bars and every file it writes
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(converter_args)
    except Exception as exc:
        raise RuntimeError(
            f"converting {source} to universal format failed: {exc}\n{chatter.getvalue()[-3000:]}"
        ) from exc


def load(engine, checkpoint: dict[str, Any], universal: bool) -> None:
    """Load model and optimizer state on every rank (a collective call).

    ``universal``: load the universal conversion (the engine must have been built with
    ``load_universal``); this restores model and optimizer state at any world size.
    """
    local = _local_dir(checkpoint["uri"])
    load_dir, tag = (local, UNIVERSAL) if universal else (os.path.dirname(local), os.path.basename(local))
    load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {checkpoint['uri']}")

"""Each node's own copy of a prepared dataset's splits, which its training workers read.

A worker reads the rows of its steps from a flat file of uint16 tokens on its node's disk (``SplitRows``),
not from the Parquet shards on shared or object storage. The first worker of a node to need a split builds
the copy, a batch at a time, while the others wait for it; the scaling policy builds it on a node before a run
grows onto it.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from train import storage
from train.manifest import SPLITS, Manifest, load_manifest, prepared_manifest, unreadable_shard
from train.split_rows import SplitRows

COPY_SOURCE = "source.json"  # in a node-local copy of a split: the dataset it was built from


def load_split(path: str, split: str) -> SplitRows:
    """The sequences of a split, indexed like a (sequences, seq_len + 1) uint16 array, in manifest order.

    Rows are read from a node-local copy of the split (built once per node, a batch at a time), so a
    worker holds in memory only the rows of its step, however large the dataset.
    """
    manifest = prepared_manifest(path)
    return SplitRows(_node_local_split(path, split, manifest), manifest.seq_len + 1)


def copy_to_this_node(path: str) -> None:
    """Build this node's copies of the dataset's splits, which ``load_split`` reads, if not built yet.

    The scaling policy runs this on a node before it grows a run onto it, so that the copy is made while
    the run trains on rather than while every worker waits for the new one.
    """
    manifest = prepared_manifest(path)
    for split in SPLITS:
        _node_local_split(path, split, manifest)


def _node_local_split(path: str, split: str, manifest: Manifest) -> str:
    """The split's tokens as one flat uint16 file on this node, keyed by the dataset's location and identity.

    Starting the copy of a dataset also drops the copies whose dataset is gone (deleted, or prepared
    again): each is as large as its dataset's tokens, and nothing else would ever remove them. It does so in
    the background: asking another dataset's storage whether it is gone may take seconds (a bucket that cannot
    be reached, retried), and no worker should wait for storage it does not train from.
    """
    source, identity = storage.absolute(path), manifest.sha256
    cache = storage.node_local_dir("data", f"{source}\n{identity}")
    local = os.path.join(cache, f"{split}.u16")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the workers of a node build it once, the others wait for it
        record = os.path.join(cache, COPY_SOURCE)
        if not os.path.exists(record):  # the dataset's first split on this node: once per dataset, not per split
            with open(record, "w") as f:
                json.dump({"path": source, "manifest_sha256": identity}, f)
            threading.Thread(target=_drop_orphaned_copies, args=(os.path.dirname(cache),), daemon=True).start()
        if not os.path.exists(local):
            # One name, as the lock makes this the node's only writer: what one killed mid-copy left goes first,
            # rather than staying beside the next copy, as large as the split.
            staging = f"{local}.partial"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            _check_room(path, split, manifest, cache)
            try:
                with open(staging, "wb") as out:
                    _write_tokens(path, manifest.split(split).shards, out)
            except BaseException:  # a copy that failed gives its disk back (checkpoints stage on the same disk)
                with contextlib.suppress(OSError):
                    os.unlink(staging)
                raise
            os.replace(staging, local)  # complete, or not there
    return local


def _check_room(path: str, split: str, manifest: Manifest, directory: str) -> None:
    """Fail at once, naming the sizes, where the split's copy cannot fit, rather than when the disk fills."""
    needed = manifest.split(split).sequences * (manifest.seq_len + 1) * 2  # uint16 tokens
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(
            errno.ENOSPC,
            f"the {split} split of {path} needs {needed / 1e6:,.1f} MB on this node and {directory} has "
            f"{free / 1e6:,.1f} MB free: give the nodes larger disks, or set TMPDIR to a folder on a larger one",
        )


def _write_tokens(path: str, shards: list[str], out) -> None:
    """The tokens of the dataset's ``shards``, in order, to the file ``out`` as uint16, a batch at a time."""
    fs, root = storage.resolve(path)
    for shard in shards:
        with fs.open_input_file(f"{root}/{shard}") as source_file:
            try:
                for batch in pq.ParquetFile(source_file).iter_batches(batch_size=8192, columns=["tokens"]):
                    out.write(batch.column("tokens").flatten().to_numpy().astype(np.uint16, copy=False).tobytes())
            except pa.ArrowInvalid as exc:  # damaged data (a copy cut short), not storage that cannot be reached
                raise ValueError(unreadable_shard(path, shard, str(exc))) from None
            except OSError as exc:
                # Storage failing mid-read, or a page damaged inside the shard: pyarrow raises both as OSError, and
                # neither names the file. The type stays, so a failed read is still retried as storage's.
                exc.add_note(f"while copying {storage.join(path, shard)} to this node")
                raise


def _drop_orphaned_copies(copies: str) -> None:
    """Delete the node-local copies whose dataset no longer holds the manifest they were built from.

    A copy another process is building (its lock held) is left, as is one whose dataset cannot be reached
    now (storage down, credentials expired): it may come back. A worker still reading a dropped copy
    keeps reading it, through the file it has open. A copy's record goes last, so that a drop cut short (its
    process ended) leaves a copy the next sweep still drops.
    """
    for name in os.listdir(copies):
        cache = os.path.join(copies, name)
        try:
            with open(os.path.join(cache, COPY_SOURCE)) as record:
                built_from = json.load(record)
            manifest = load_manifest(built_from["path"])
        except (OSError, ValueError, KeyError):  # no record yet, or the dataset cannot be read now
            continue
        if manifest is not None and manifest.sha256 == built_from["manifest_sha256"]:
            continue
        with contextlib.suppress(OSError), open(os.path.join(cache, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while another process builds it
            for file in os.listdir(cache):
                if file != COPY_SOURCE:
                    os.unlink(os.path.join(cache, file))
            shutil.rmtree(cache, ignore_errors=True)

"""Local paths and object-storage URIs behind one interface (pyarrow filesystems)."""

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

logger = logging.getLogger(__name__)


# pyarrow's GCS client retries a transient error for 15 minutes (google-cloud-cpp's default), so each call to a
# bucket that cannot be reached, or with credentials that cannot be had, hung that long: give up in seconds, as its
# S3 client does after three tries, and let raywright's own waits (run.storage_wait_s, checkpoint.failures_tolerated)
# ride out an outage (Arrow's docs suggest 15 s: apache/arrow#13681). A `retry_limit_seconds` in the URI wins.
GCS_RETRY_LIMIT_S = 15


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path within it for a local path or a URI (s3://, gs://, file://)."""
    if "://" in uri:
        if uri.startswith(("gs://", "gcs://")) and "retry_limit_seconds=" not in uri:
            uri += f"{'&' if '?' in uri else '?'}retry_limit_seconds={GCS_RETRY_LIMIT_S}"
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def absolute(uri: str) -> str:
    """A URI as it is, a local path made absolute (what Ray and the workers need)."""
    return uri if "://" in uri else resolve(uri)[1]


def is_local(uri: str) -> bool:
    return isinstance(resolve(uri)[0], pafs.LocalFileSystem)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A local disk that filled up while raywright wrote to it: what the CLIs say in one line (exit code 1)."""


def disk_full(error: BaseException, what: str, path: str) -> DiskFullError | None:
    """``error`` as a ``DiskFullError`` naming ``what`` and the free space at ``path``, where it or one of its causes
    (a Ray task's included) is "no space left on device" or "disk quota exceeded" (the user's share of a shared
    disk used up: as full for them); else None."""
    causes = itertools.islice(_causes(error), 20)
    full = next((cause.errno for cause in causes if getattr(cause, "errno", None) in FULL_DISK), None)
    if full is None:
        return None
    where, free = free_space(path)
    why = "disk quota exceeded" if full == errno.EDQUOT else "no space left"
    return DiskFullError(f"{what}: {why} on the disk holding {where} ({free / 2**20:.1f} MiB free)")


def free_space(path: str) -> tuple[str, int]:
    """The nearest existing folder at or above the local ``path`` (what a failed write left of it may be gone), and
    the bytes free on its disk."""
    path = nearest_existing(path)
    return path, shutil.disk_usage(path).free


def nearest_existing(path: str) -> str:
    """The local ``path``, or its nearest ancestor that exists."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _causes(error: BaseException | None) -> Iterator[BaseException]:
    while error is not None:
        yield error
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__  # RayTaskError's: ``cause``


def node_local_dir(purpose: str, key: str) -> str:
    """This node's folder for ``key`` under ``$TMPDIR/raywright-<purpose>/`` (named by a hash of the key):
    raywright's own local copies of what lives elsewhere, which it alone creates and deletes."""
    return os.path.join(tempfile.gettempdir(), f"raywright-{purpose}", hashlib.sha256(key.encode()).hexdigest()[:16])


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def wait_until_reachable(uris: list[str], timeout_s: float, poll_s: float = 2.0) -> float:
    """Wait until each of ``uris`` answers (whether it exists or not); the seconds waited, 0 where they answered
    at once.

    Storage that cannot be reached (an outage, a network partition) is asked again every ``poll_s`` (besides
    pyarrow's own retries) and logged once; past ``timeout_s`` the last error is raised.
    """
    started, waiting = time.monotonic(), False
    while True:
        try:
            for uri in uris:
                exists(uri)
            break
        except OSError as exc:
            if time.monotonic() - started >= timeout_s:
                raise
            if not waiting:
                logger.warning("storage cannot be reached, waiting up to %.0f s for it: %s", timeout_s, exc)
                waiting = True
            time.sleep(poll_s)
    if not waiting:
        return 0.0
    waited = time.monotonic() - started
    logger.warning("storage answered after %.1f s", waited)
    return waited


def list_dir(uri: str) -> list[str]:
    """Names of the entries directly inside ``uri`` (empty if it does not exist)."""
    fs, path = resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(info.base_name for info in infos)


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole file. Locally to a temporary name, synced to disk, then renamed: readers and a crash
    never leave half of it. An object store's PUT is whole by itself."""
    fs, path = resolve(uri)
    fs.create_dir(os.path.dirname(path), recursive=True)
    if not isinstance(fs, pafs.LocalFileSystem):
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    staging = f"{path}.{os.getpid()}.tmp"
    try:
        with open(staging, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)
    except BaseException:  # a full disk: what it holds of the file would stay behind
        with contextlib.suppress(OSError):
            os.remove(staging)
        raise


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def open_input_file(uri: str) -> pa.NativeFile:
    """``uri`` open for reads at any offset (``size``, ``read_at``): only the bytes asked for are fetched."""
    fs, path = resolve(uri)
    return fs.open_input_file(path)


def read_if_exists(uri: str) -> bytes | None:
    """``uri``'s bytes, or None where it does not exist: one request where ``exists`` then ``read_bytes`` make two.
    Storage that cannot be reached still raises (an OSError): it is not taken for a file that is not there."""
    try:
        return read_bytes(uri)
    except FileNotFoundError:
        return None


def read_json_if_exists(uri: str) -> Any | None:
    data = read_if_exists(uri)
    return None if data is None else json.loads(data)


def write_json(uri: str, value: Any) -> None:
    write_bytes(uri, json.dumps(value, indent=2, sort_keys=True).encode())


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri))


def copy_dir(src: str, dst: str, names: list[str] | None = None) -> None:
    """Copy every file under ``src``, or only ``names`` (paths relative to it), into ``dst`` (merging with
    what is there)."""
    src_fs, src_path = resolve(src)
    dst_fs, dst_path = resolve(dst)
    dst_fs.create_dir(dst_path, recursive=True)
    if names is None:
        pafs.copy_files(src_path, dst_path, source_filesystem=src_fs, destination_filesystem=dst_fs)
        return

    def copy(name: str) -> None:
        target = f"{dst_path}/{name}"
        dst_fs.create_dir(os.path.dirname(target), recursive=True)
        pafs.copy_files(f"{src_path}/{name}", target, source_filesystem=src_fs, destination_filesystem=dst_fs)

    with ThreadPoolExecutor(max_workers=8) as pool:  # several files at once, as pyarrow copies a directory
        list(pool.map(copy, names))


def delete_file(uri: str) -> None:
    fs, path = resolve(uri)
    fs.delete_file(path)


def delete_dir(uri: str) -> None:
    fs, path = resolve(uri)
    fs.delete_dir(path)

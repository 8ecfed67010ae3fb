"""A run's side files (metrics, the sample log, TensorBoard events) in ``<run>/``, wherever the run lives.

Local storage is appended to in place. Object storage has no append: the writer keeps a node-local copy,
started from what the run's storage already holds (a writer on another node, such as rank 0 after a
restart, continues the file; one opened during an outage reads it before its first upload) and from the
records an earlier writer on this node left unuploaded, and uploads it whole when the caller flushes (the
metrics recorder every ``run.side_files_upload_s`` and at the end, the sample log at each checkpoint and at
the end). An upload that fails (storage unreachable) is logged and left to the next flush: side files never
stop a run, and the node's copy holds everything meanwhile. So is a write to the node's disk that fails (a
full disk): the records wait in memory for the next. At the end the copy is deleted once uploaded: a
node that outlives many runs keeps none of their side files."""

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from train import storage

logger = logging.getLogger(__name__)
Record = tuple[float, bytes]  # a JSON line and the time it holds, what the merge of two copies orders by


def node_local_copy(uri: str) -> str:
    """The path of this node's copy of a remote run file or directory."""
    return os.path.join(storage.node_local_dir("run-files", uri), os.path.basename(uri.rstrip("/")))


def drop_node_local_copy(uri: str) -> None:
    """Delete this node's copy of ``uri`` (nothing to do for local storage, where the run's file is the copy)."""
    if not storage.is_local(uri):
        shutil.rmtree(storage.node_local_dir("run-files", uri), ignore_errors=True)


def local_path(uri: str) -> str:
    """Where this node writes ``uri``: the path itself on local storage, else its node-local copy."""
    return storage.resolve(uri)[1] if storage.is_local(uri) else node_local_copy(uri)


class JsonlLog:
    """Append-only JSON lines at ``uri``, each record stamped with the ``time`` it was appended (unless it has its
    own): what orders the records of two writers when one's copy is merged into the other's."""

    def __init__(self, uri: str):
        self.uri = uri
        self.remote = not storage.is_local(uri)
        self.path = local_path(uri)
        self._unflushed = False  # appended to since the last upload
        self._unwritten: list[str] = []  # lines a write could not add to the file (a full disk): tried again
        self._write_failing = False
        # Where the file may end in part of a line (a writer killed while it appended, a failed write): that line is
        # ended before the next record, which then starts a line of its own, and only the cut one is dropped.
        self._may_end_in_a_cut_line = not self.remote
        self._continued = not self.remote  # whether the local copy starts with what ``uri`` held
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if self.remote:
            # A copy already here is an earlier writer's that did not upload all of it (its upload failed, or it
            # was killed): what of it belongs to this run is merged in when the stored records are read.
            open(self.path, "ab").close()
            self._kept = os.path.getsize(self.path)  # bytes at the start of the copy
            self._unflushed = self._kept > 0
            self._continue_stored()

    def _continue_stored(self) -> bool:
        """Merge what ``uri`` holds with the records of this node's copy. While storage cannot be read, this is
        logged and left to the next flush: a log opened in an outage (a resumed driver's first report) must not
        raise."""
        try:
            stored = storage.read_if_exists(self.uri) or b""
        except OSError as exc:
            logger.warning("could not read %s (read again before the next upload): %s", self.uri, exc)
            return False
        with open(self.path, "rb") as f:
            local = f.read()
        if local:  # records appended here, or kept from an earlier writer: merged with the stored ones
            stored_records = _records(stored)
            kept, appended = _records(local[: self._kept]), _records(local[self._kept :])
            stored = _merged(stored_records, _of_the_run(kept, stored_records) + appended)
        with open(self.path, "wb") as f:
            f.write(stored)
        self._continued = True
        return True

    def append(self, record: dict[str, Any]) -> None:
        self._unwritten.append(json.dumps({"time": time.time(), **record}) + "\n")
        self._write()

    def _write(self) -> bool:
        """Add the lines not yet in the file to it; returns whether they all are. A write that fails (a full disk)
        is logged once and tried again at the next append or flush: side files never stop a run."""
        try:
            if self._may_end_in_a_cut_line:
                _end_a_cut_line(self.path)
                self._may_end_in_a_cut_line = False
            with open(self.path, "a") as f:
                while self._unwritten:
                    f.write(self._unwritten[0])
                    f.flush()
                    self._unwritten.pop(0)
                    self._unflushed = True
        except OSError as exc:
            self._may_end_in_a_cut_line = True
            if not self._write_failing:
                logger.warning(
                    "could not write %s (its records are kept, and written with the next): %s", self.path, exc
                )
            self._write_failing = True
            return False
        self._write_failing = False
        return True

    def flush(self) -> bool:
        """Make everything appended so far visible at ``uri`` (an upload only if something was appended); returns
        whether it is. A failed upload is logged, and the next flush uploads everything again."""
        if not self._write():
            return False
        if self.remote and self._unflushed:
            if not self._continued and not self._continue_stored():
                return False  # uploading now would replace the records that ``uri`` holds
            with open(self.path, "rb") as f:
                if not try_upload(lambda: storage.write_bytes(self.uri, f.read()), self.uri, self.path):
                    return False
        self._unflushed = False
        return True

    def close(self) -> None:
        """Flush, and delete this node's copy once uploaded: a later ``JsonlLog(uri)`` starts again from what
        ``uri`` holds. Where the upload failed, the copy stays, the only one with every record (logged), and a
        later writer of ``uri`` on this node merges it in."""
        if self.flush():
            drop_node_local_copy(self.uri)
        elif self._unwritten:
            logger.warning("%d records of %s could not be written, and are lost", len(self._unwritten), self.uri)
        else:
            logger.warning("%s keeps the records %s lacks", self.path, self.uri)


def _parsed_lines(jsonl: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """Each line's record, with the line. A line that is not JSON, the last append of a writer killed while it
    wrote, is dropped (logged): it must not end the run that reads the log or merges a copy of it."""
    parsed = []
    for line in jsonl.splitlines():
        try:
            parsed.append((json.loads(line), line))
        except ValueError:
            logger.warning("dropped a record cut short: %r", line[:200])
    return parsed


def _records(jsonl: bytes) -> list[Record]:
    """Each line with its record's time (a log written before records were stamped has none: the oldest)."""
    return [(record.get("time", 0.0), line) for record, line in _parsed_lines(jsonl)]


def _end_a_cut_line(path: str) -> None:
    """End the last line of the local log ``path`` where a writer killed while it appended, or a write that failed,
    left it without its newline."""
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _of_the_run(kept: list[Record], stored: list[Record]) -> list[Record]:
    """The records of a copy an earlier writer on this node left that belong to the run storage holds: those
    since its first record. Storage holding none, the run is a new one (where a run of the same name was deleted)."""
    return [record for record in kept if record[0] >= stored[0][0]] if stored else []


def _merged(stored: list[Record], local: list[Record]) -> bytes:
    """The records of both, each once, in time order: ``local`` may hold records that ``stored`` holds too (those a
    writer continued) and records older than some ``stored`` holds (a copy left while a writer elsewhere went on)."""
    unique = dict.fromkeys(stored + local)
    return b"".join(line + b"\n" for _, line in sorted(unique))


def try_upload(upload: Callable[[], None], uri: str, local: str) -> bool:
    """Run ``upload`` of ``local`` to ``uri``; an OSError (storage unreachable) is logged, not raised."""
    try:
        upload()
    except OSError as exc:
        logger.warning("could not upload %s to %s (retried at the next upload): %s", local, uri, exc)
        return False
    return True


def read_jsonl(uri: str) -> list[dict[str, Any]]:
    """The records of the log ``uri`` (none where there is no file), but for a line cut short."""
    return [record for record, _ in _parsed_lines(storage.read_if_exists(uri) or b"")]


def local_dir_for(uri: str) -> str:
    """A local directory to write ``uri``'s files in: itself, or a node-local copy to upload with
    ``upload_dir``."""
    path = local_path(uri)
    os.makedirs(path, exist_ok=True)
    return path


def upload_dir(local: str, uri: str) -> None:
    """Copy a directory from ``local_dir_for(uri)`` to ``uri`` (nothing to do for local storage)."""
    if not storage.is_local(uri):
        storage.copy_dir(local, uri)

"""Storage that fails: an outage waited out, as a (re)starting training worker does before it reads its run; a
write that a full disk cuts short."""

import errno
import threading
import time

import pytest

from tests.conftest import fill
from train import storage

pytestmark = pytest.mark.unit


def test_storage_that_comes_back_is_waited_for_and_storage_that_stays_down_fails_after_the_wait(
    s3_server, s3_bucket, tmp_path, caplog
):
    run = f"{s3_bucket}/wait-{time.time_ns()}"
    assert storage.wait_until_reachable([run, str(tmp_path)], timeout_s=60) == 0.0  # answers at once, not found

    s3_server.stop()
    back = threading.Timer(8, s3_server.start)
    back.start()
    try:
        waited = storage.wait_until_reachable([str(tmp_path), run], timeout_s=120, poll_s=0.5)
    finally:
        back.join()
    assert waited >= 7
    assert "storage cannot be reached, waiting up to 120 s" in caplog.text and "storage answered after" in caplog.text

    with s3_server.outage(), pytest.raises(OSError, match="NETWORK_CONNECTION"):
        storage.wait_until_reachable([run], timeout_s=1, poll_s=0.5)


def test_a_file_that_is_not_there_reads_as_none_and_storage_that_is_down_raises(s3_server, s3_bucket, tmp_path):
    """One request instead of exists-then-read; an outage must not pass for a missing file (a lease read as free)."""
    for root in (str(tmp_path), f"{s3_bucket}/read-{time.time_ns()}"):
        uri = storage.join(root, "lease.json")
        assert storage.read_if_exists(uri) is None and storage.read_json_if_exists(uri) is None
        storage.write_json(uri, {"token": "abc"})
        assert storage.read_json_if_exists(uri) == {"token": "abc"}
    with s3_server.outage(), pytest.raises(OSError) as raised:
        storage.read_if_exists(uri)
    assert not isinstance(raised.value, FileNotFoundError)


def test_a_write_that_a_full_disk_cuts_short_leaves_nothing_behind(small_disk):
    """Before, its temporary file stayed: on a full disk, space that the next write lacked."""
    fill(small_disk)
    with pytest.raises(OSError, match="No space left on device"):
        storage.write_bytes(str(small_disk / "timeline.json"), b"x" * 100_000)
    assert sorted(path.name for path in small_disk.iterdir()) == ["filler"]


@pytest.mark.parametrize(
    ("code", "said"), [(errno.ENOSPC, "no space left"), (errno.EDQUOT, "disk quota exceeded"), (errno.EIO, None)]
)
def test_a_full_disk_or_a_used_up_quota_is_a_disk_full_error_naming_the_disk(tmp_path, code, said):
    """A quota (a shared disk's) used up fails writes as a full disk does, so it must stop a run alike."""
    try:
        try:
            raise OSError(code, "from the write")
        except OSError as write:
            raise RuntimeError("a worker's checkpoint failed") from write
    except RuntimeError as error:
        full = storage.disk_full(error, "checkpoint step_00000010", str(tmp_path / "run" / "checkpoints"))
    if said is None:
        assert full is None
    else:
        assert str(full).startswith(f"checkpoint step_00000010: {said} on the disk holding {tmp_path} (")

"""Side files of a run on object storage: appended on a node, visible when flushed, continued elsewhere."""

import os
import time

import pytest

from train.run_files import JsonlLog, drop_node_local_copy, node_local_copy, read_jsonl

pytestmark = pytest.mark.unit


def test_a_remote_log_is_uploaded_when_flushed_continued_by_a_writer_on_another_node_and_left_nowhere_else(
    s3_bucket,
):
    uri = f"{s3_bucket}/run-files-{time.time_ns()}/samples.jsonl"
    log = JsonlLog(uri)
    log.append({"step": 1})
    log.append({"step": 2})
    assert read_jsonl(uri) == []  # an object store has no append: nothing until the flush
    log.flush()
    assert read_jsonl(uri) == [{"step": 1}, {"step": 2}]

    drop_node_local_copy(uri)  # rank 0 restarts on another node
    continued = JsonlLog(uri)
    continued.append({"step": 3})
    continued.close()  # the run's end
    assert [record["step"] for record in read_jsonl(uri)] == [1, 2, 3]
    assert not os.path.exists(os.path.dirname(node_local_copy(uri)))


def test_a_local_log_is_appended_in_place(tmp_path):
    uri = str(tmp_path / "run" / "metrics.jsonl")
    JsonlLog(uri).append({"step": 1})
    JsonlLog(uri).append({"step": 2})
    assert read_jsonl(uri) == [{"step": 1}, {"step": 2}]

"""Side files of a run on object storage: appended on a node, visible when flushed, continued elsewhere,
kept through a storage outage."""

import json
import os
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import fill
from train import storage
from train.metrics import METRICS, MetricsRecorder, read_metrics
from train.run_files import JsonlLog, drop_node_local_copy, node_local_copy, read_jsonl

pytestmark = pytest.mark.unit


def steps(uri: str) -> list[int]:
    return [record["step"] for record in read_jsonl(uri)]


def store_from_another_node(uri: str, record: dict, node_copy: str, aside: str) -> None:
    """A writer on another node stores ``record``; this node's copy of ``uri`` is set aside meanwhile (both
    nodes are this machine), as it would sit on its own node."""
    os.replace(node_copy, aside)
    elsewhere = JsonlLog(uri)
    elsewhere.append(record)
    elsewhere.close()
    os.makedirs(os.path.dirname(node_copy))
    os.replace(aside, node_copy)


def test_a_remote_log_is_uploaded_when_flushed_continued_by_a_writer_on_another_node_and_left_nowhere_else(
    s3_bucket,
):
    uri = f"{s3_bucket}/run-files-{time.time_ns()}/samples.jsonl"
    log = JsonlLog(uri)
    log.append({"step": 1})
    log.append({"step": 2})
    assert steps(uri) == []  # an object store has no append: nothing until the flush
    log.flush()
    assert steps(uri) == [1, 2]

    drop_node_local_copy(uri)  # rank 0 restarts on another node
    continued = JsonlLog(uri)
    continued.append({"step": 3})
    continued.close()  # the run's end
    assert steps(uri) == [1, 2, 3]
    assert not os.path.exists(os.path.dirname(node_local_copy(uri)))


def test_a_local_log_is_appended_in_place(tmp_path):
    uri = str(tmp_path / "run" / "metrics.jsonl")
    JsonlLog(uri).append({"step": 1})
    JsonlLog(uri).append({"step": 2})
    assert steps(uri) == [1, 2]


def test_a_local_log_on_a_full_disk_keeps_its_records_and_writes_them_once_there_is_room(small_disk, caplog):
    uri = str(small_disk / "run" / "metrics.jsonl")
    log = JsonlLog(uri)
    # The first record ends 10 bytes short of its page: the next needs a page the full disk has not got.
    without_pad = len(json.dumps({"time": time.time(), "step": 1, "pad": ""})) + 1
    log.append({"step": 1, "pad": "x" * (os.sysconf("SC_PAGE_SIZE") - 10 - without_pad)})
    filler = fill(small_disk)
    log.append({"step": 2, "note": "longer than what is left of the page"})  # cut short where the page ends
    log.append({"step": 3})
    assert steps(uri) == [1]
    filler.unlink()
    log.append({"step": 4})
    assert steps(uri) == [1, 2, 3, 4]  # each once, whole, in order: the cut one is dropped as a reader meets it
    failures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("could not write")]
    assert len(failures) == 1 and "No space left on device" in failures[0]  # logged once, not per record


# TensorBoard's writer thread dies of the full disk with a traceback of its own; its writer raises that failure again.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_metrics_on_a_full_disk_do_not_end_the_run_and_are_all_written_once_there_is_room(small_disk):
    """An exception here would end the run: Ray Train does not retry a callback's."""
    run = str(small_disk / "run")
    recorder = MetricsRecorder(run, max_steps=3, upload_every_s=30)
    filler = fill(small_disk)
    recorder.after_report(None, [{"step": 1, "loss": 5.0}], None)
    recorder.after_report(None, [{"step": 2, "loss": 4.0}], None)
    filler.unlink()
    recorder.after_report(None, [{"step": 3, "loss": 3.0}], None)  # the last: closes both
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    events = EventAccumulator(str(small_disk / "run" / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("loss")] == [3]  # those written once the disk had room


def test_a_record_cut_short_by_a_killed_writer_loses_no_other_record(tmp_path, caplog):
    uri = str(tmp_path / "run" / "metrics.jsonl")
    JsonlLog(uri).append({"step": 1})
    with open(uri, "a") as f:
        f.write('{"step": 2, "lo')  # the writer was killed while it appended step 2
    JsonlLog(uri).append({"step": 3})  # the run's next writer
    assert steps(uri) == [1, 3]
    assert "dropped a record cut short" in caplog.text


def test_a_log_whose_storage_is_down_keeps_every_record_until_an_upload_succeeds(s3_server, s3_bucket, caplog):
    uri = f"{s3_bucket}/run-files-{time.time_ns()}/samples.jsonl"
    log = JsonlLog(uri)
    log.append({"step": 1})
    assert log.flush()
    log.append({"step": 2})
    with s3_server.outage():
        log.close()  # the run's end: logged, not raised (side files never stop a run); the node's copy stays
    assert "could not upload" in caplog.text and f"{log.path} keeps the records" in caplog.text
    assert steps(uri) == [1]
    log.close()  # storage is back
    assert steps(uri) == [1, 2]
    assert not os.path.exists(log.path)


def test_a_log_opened_while_its_storage_is_down_continues_what_storage_holds_once_it_is_back(
    s3_server, s3_bucket, caplog
):
    """A resumed driver's first report can come in an outage: the log opens anyway (an exception in the metrics
    recorder would end the run) and puts the earlier driver's records first when it can read them."""
    uri = f"{s3_bucket}/run-files-{time.time_ns()}/metrics.jsonl"
    earlier = JsonlLog(uri)
    earlier.append({"step": 1})
    earlier.close()
    with s3_server.outage():
        log = JsonlLog(uri)
        log.append({"step": 2})
        assert not log.flush()
    assert f"could not read {uri}" in caplog.text
    log.append({"step": 3})
    log.close()
    assert steps(uri) == [1, 2, 3]
    assert not os.path.exists(log.path)


def test_a_copy_an_upload_failed_to_store_is_merged_in_time_order_by_the_next_writer_on_its_node(
    s3_server, s3_bucket, tmp_path
):
    """A driver resumed where the last could not upload its records (or was killed first) keeps them, in the order
    they were written, also when a writer elsewhere stored records in between."""
    uri = f"{s3_bucket}/run-files-{time.time_ns()}/samples.jsonl"
    first = JsonlLog(uri)
    first.append({"step": 1})
    assert first.flush()
    first.append({"step": 2, "by": "first"})
    with s3_server.outage():
        first.close()  # the node keeps its copy, with step 2
    store_from_another_node(uri, {"step": 2, "by": "elsewhere"}, first.path, tmp_path / "kept")  # rank 0 redoes 2
    with open(first.path, "a") as f:
        f.write('{"time": 1e10, "step": 3, "by": "fir')  # an append cut short by a kill: dropped

    back = JsonlLog(uri)  # rank 0 back on the first node
    back.append({"step": 3})
    back.close()
    records = [(record["step"], record.get("by")) for record in read_jsonl(uri)]
    assert records == [(1, None), (2, "first"), (2, "elsewhere"), (3, None)]  # a redone step's last record counts
    assert not os.path.exists(back.path)


@pytest.mark.parametrize("new_run_first_stored_by", ["this node", "another node"])
def test_a_copy_left_by_a_deleted_run_is_not_merged_into_a_new_run_of_the_same_name(
    s3_bucket, tmp_path, new_run_first_stored_by
):
    uri = f"{s3_bucket}/run-files-{time.time_ns()}/metrics.jsonl"
    deleted = JsonlLog(uri)
    deleted.append({"step": 1, "run": "deleted"})  # its driver is killed: the node keeps the copy
    # The user deletes the run (it never stored a record) and starts one of the same name.
    if new_run_first_stored_by == "another node":
        store_from_another_node(uri, {"step": 1, "run": "new"}, deleted.path, tmp_path / "kept")
    log = JsonlLog(uri)
    log.append({"step": 2, "run": "new"})
    log.close()
    new_run = [1, 2] if new_run_first_stored_by == "another node" else [2]
    assert [(record["step"], record["run"]) for record in read_jsonl(uri)] == [(step, "new") for step in new_run]


def test_a_run_goes_on_through_failed_metrics_uploads_and_loses_no_report(s3_server, s3_bucket, caplog):
    """Ray Train ends a run whose callback raises; an upload that fails is retried at the next instead."""
    run_uri = f"{s3_bucket}/metrics-{time.time_ns()}"
    recorder = MetricsRecorder(run_uri, max_steps=3, upload_every_s=30)
    recorder.after_report(None, [{"step": 1, "loss": 3.0}], None)
    with s3_server.outage():
        recorder.after_report(None, [{"step": 2, "loss": 2.0, "checkpoint": "step_2"}], None)  # uploads: fails
    assert "could not upload" in caplog.text
    recorder.after_report(None, [{"step": 3, "loss": 1.0}], None)  # the last: uploads every report
    assert [m["step"] for m in read_metrics(run_uri)] == [1, 2, 3]
    assert not os.path.exists(storage.node_local_dir("run-files", f"{run_uri}/{METRICS}"))

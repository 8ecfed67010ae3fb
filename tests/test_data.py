import gzip
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import ray.data
from ray._common.test_utils import wait_for_condition
from ray.data._internal.logging import get_log_directory

from tests.conftest import fill, interrupt_when, write_a_prepared_dataset
from train.config import DataConfig, load_config
from train.data import (
    LAGGING_NO_CPU_WARNING,
    _files_below,
    _ray_data_logs_to_file_only,
    bpe_sample,
    dataset_path,
    list_source,
    prepare,
    split_documents,
)
from train.loader import SampleOrder, micro_batch_samples
from train.manifest import load_manifest
from train.node_copy import COPY_SOURCE, load_split
from train.schema import ConfigError, replace
from train.text_files import MIN_DOCUMENTS, MIN_PIECE_BYTES, PIECE_BYTES, TextFiles, piece_bytes, text_pieces
from train.tokenizer import ByteTokenizer, load_tokenizer, train_bpe


def _documents(n: int = 60) -> list[str]:
    rng = random.Random(0)
    words = ["ray", "train", "spot", "node", "zero", "grad", "élan", "数据", "batch", "step"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) for _ in range(n)]


@pytest.mark.cluster
def test_prepared_sequences_are_the_corpus_bytes(tiny_dataset, corpus_dir):
    manifest = load_manifest(tiny_dataset)
    train, val = load_split(tiny_dataset, "train"), load_split(tiny_dataset, "val")
    assert train.shape == (manifest.train.sequences, manifest.seq_len + 1)
    assert val.shape[0] == manifest.val.sequences > 0
    assert manifest.documents == len(list(corpus_dir.rglob("*.py")))
    corpus = b"".join(p.read_bytes() for p in corpus_dir.rglob("*.py"))
    tokenizer = ByteTokenizer()
    for row in (train[0], train[len(train) // 2], val[0]):
        # A sequence is document bytes with end-of-text tokens between documents.
        for piece in tokenizer.decode(row).split(b"\n")[1:-1]:
            assert piece in corpus


@pytest.mark.cluster
def test_bpe_prepare_reports_tokens_per_byte_and_its_tokenizer_is_reusable_by_path(tiny_dataset, corpus_dir, tmp_path):
    out = str(tmp_path / "bpe")
    bpe = DataConfig(source=f"{corpus_dir}/**/*.py", val_fraction=0.1, tokenizer="bpe", vocab_size=1024)
    manifest = prepare(bpe, out, seq_len=64)
    tokenizer = load_tokenizer(out)
    assert manifest.tokenizer == tokenizer.spec() and tokenizer.vocab_size == 1024
    # Python source compresses to well under half a token per byte; the byte tokenizer is 1 (+ end-of-text).
    assert manifest.tokens_per_byte < 0.5 < 1.0 < load_manifest(tiny_dataset).tokens_per_byte < 1.01
    assert manifest.source_sha256 == load_manifest(tiny_dataset).source_sha256
    corpus = b"".join(p.read_bytes() for p in corpus_dir.rglob("*.py"))
    rows = load_split(out, "train")
    assert rows.shape[1] == 65 and rows[:].max() < 1024
    for row in (rows[0], rows[len(rows) // 2]):
        for piece in tokenizer.decode(row).split(b"\n")[1:-1]:
            assert piece in corpus
    # Preparing with that tokenizer file gives the same sequences: a tokenizer is reusable by path.
    again = prepare(replace(bpe, tokenizer=f"{out}/tokenizer.json"), str(tmp_path / "again"), 64)
    assert again.tokenizer == manifest.tokenizer
    assert np.array_equal(load_split(str(tmp_path / "again"), "train"), rows)


@pytest.mark.cluster
def test_a_bpe_trains_on_an_even_sample_of_a_training_split_larger_than_bpe_train_bytes(ray_session, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(_documents(400)):
        (corpus / f"doc{i}.txt").write_text(text)
    docs, sums = split_documents(str(corpus), val_fraction=0.1)
    training = {row["digest"]: row for row in docs.take_all() if row["split"] == "train"}
    train_bytes = sum(row["num_bytes"] for row in training.values())
    assert sums["train"] == {"documents": len(training), "num_bytes": train_bytes}
    for at_most in (0, train_bytes):  # no limit, and one the split fits: all of it, nothing said
        assert {row["digest"] for row in bpe_sample(docs, train_bytes, at_most).take_all()} == training.keys()
    assert capsys.readouterr().out == ""

    sample = bpe_sample(docs, train_bytes, train_bytes // 4).take_all()
    assert {row["digest"] for row in sample} <= training.keys()
    # The documents' hashes choose it apart from their split: a sample by the split's own hash bytes would hold
    # (0.25 - 0.1) / 0.9 of the training bytes, not a quarter.
    assert 0.85 < sum(row["num_bytes"] for row in sample) / (train_bytes / 4) < 1.15
    said = f"training the BPE on ~{train_bytes // 4 / 1e6:,.1f} MB of the training split's {train_bytes / 1e6:,.1f} MB"
    assert said in capsys.readouterr().out
    # prepare trains its BPE on that sample.
    out = str(tmp_path / "prepared")
    sampled = DataConfig(source=str(corpus), val_fraction=0.1, tokenizer="bpe", vocab_size=300)
    prepare(replace(sampled, bpe_train_bytes=train_bytes // 4), out, 32)
    on_sample = train_bpe([row["text"].decode() for row in sample], vocab_size=300)
    assert load_tokenizer(out).spec() == on_sample.spec()


@pytest.mark.unit
def test_a_bpe_sampled_otherwise_is_prepared_apart_and_one_sampled_by_default_keeps_its_dataset():
    cfg = load_config("tiny", ["data.tokenizer=bpe"])
    data = cfg.data
    # The name its settings gave before data.bpe_train_bytes: a dataset prepared then is found, not prepared again.
    before = json.dumps([data.source, data.text_column, data.val_fraction, "bpe", data.vocab_size, cfg.model.seq_len])
    assert dataset_path(cfg).endswith(f"/datasets/{hashlib.sha256(before.encode()).hexdigest()[:12]}")
    assert dataset_path(load_config("tiny", ["data.tokenizer=bpe", "data.bpe_train_bytes=0"])) != dataset_path(cfg)


@pytest.mark.cluster
def test_the_same_corpus_gives_the_same_sequences_on_a_ray_of_another_size(
    ray_session, corpus_dir, tmp_path, monkeypatch
):
    """Ray Data blocks the documents by the cluster's CPUs (this session's Ray has 4); the packing must not follow
    it, or a corpus prepared on a laptop and on a cluster would train on different sequences."""
    monkeypatch.setattr("train.data.TOKENS_PER_PACK", 1 << 16)  # several groups of documents, as a large corpus has
    source = f"{corpus_dir}/**/*.py"
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    prepare(DataConfig(source=source, val_fraction=0.1), here, seq_len=64)
    ray_dir = tempfile.mkdtemp(prefix="/tmp/rwd-")  # short: Ray's socket paths must fit 107 bytes
    one_cpu = textwrap.dedent(f"""
        import ray
        import train.data
        from train.config import DataConfig
        ray.init(num_cpus=1, include_dashboard=False, _temp_dir={ray_dir!r})
        train.data.TOKENS_PER_PACK = 1 << 16
        train.data.prepare(DataConfig(source={source!r}, val_fraction=0.1), {there!r}, seq_len=64)
    """)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a Ray of its own
    try:
        subprocess.run([sys.executable, "-c", one_cpu], env=env, check=True, timeout=600)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    for split in ("train", "val"):
        assert np.array_equal(load_split(here, split)[:], load_split(there, split)[:]), split


@pytest.mark.cluster
def test_same_documents_as_text_jsonl_and_parquet_compressed_or_not_give_the_same_source_hash(ray_session, tmp_path):
    docs = _documents()
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    for i, doc in enumerate(docs):
        (text_dir / f"doc{i:03}.txt").write_text(doc)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"body": docs, "other": list(range(len(docs)))}), tmp_path / "docs.parquet")
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs)
    (tmp_path / "gzipped").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "gzipped" / f"doc{i:03}.txt.gz").write_bytes(gzip.compress(doc.encode()))
    categories = pa.table({"body": pa.array(docs).dictionary_encode()})  # as pandas writes a category column
    pq.write_table(categories, tmp_path / "categories.parquet")

    manifests = [
        prepare(DataConfig(source=str(source), val_fraction=0.2, text_column=column), str(tmp_path / out), 32)
        for source, column, out in [
            (text_dir, "text", "out-text"),
            (tmp_path / "docs.jsonl", "body", "out-jsonl"),
            (tmp_path / "docs.parquet", "body", "out-parquet"),
            (tmp_path / "categories.parquet", "body", "out-categories"),
            (tmp_path / "docs.jsonl.gz", "body", "out-jsonl-gz"),
            (tmp_path / "gzipped", "text", "out-text-gz"),
        ]
    ]
    assert len({m.source_sha256 for m in manifests}) == 1
    assert all(m.documents == len(docs) for m in manifests)
    # Preparing again gives identical sequences, in the same order.
    first = {split: load_split(str(tmp_path / "out-text"), split) for split in ("train", "val")}
    prepare(DataConfig(source=str(text_dir), val_fraction=0.2), str(tmp_path / "out-text"), seq_len=32)
    for split, rows in first.items():
        assert np.array_equal(rows, load_split(str(tmp_path / "out-text"), split))


@pytest.fixture
def ray_data_console(ray_session) -> Iterator[io.StringIO]:
    """What Ray Data's console handler prints in this process (it holds the stderr of when ray.data was imported,
    which under pytest is no captured stream)."""
    import ray.data  # noqa: F401  (configures the "ray.data" logger)

    (console,) = [h for h in logging.getLogger("ray.data").handlers if type(h).__name__ == "PlainRayHandler"]
    printed = io.StringIO()
    stream = console.setStream(printed)
    yield printed
    console.setStream(stream)


@pytest.mark.cluster
def test_preparing_a_corpus_leaves_ray_datas_progress_in_its_log_and_the_console_to_raywright(
    ray_data_console, corpus_dir, tmp_path
):
    """The first `python -m train` printed ~60 lines of Ray Data's plans and progress, and a warning that the
    preparation would hang for want of CPUs (Ray's view of free CPUs lagging the tasks that had just ended)."""
    ray_data_log = Path(get_log_directory(), "ray-data.log")
    logged_before = ray_data_log.stat().st_size if ray_data_log.exists() else 0
    prepare(DataConfig(source=f"{corpus_dir}/email/**/*.py", val_fraction=0.2), str(tmp_path / "out"), seq_len=32)
    assert ray_data_console.getvalue() == ""
    with open(ray_data_log) as log:
        log.seek(logged_before)
        logged = log.read()
    assert "Starting execution of Dataset" in logged and "Data sink Parquet finished" in logged, logged
    # Ray Data's other warnings still reach the console, and the console is as it was once preparing ends.
    ray_data = logging.getLogger("ray.data")
    with _ray_data_logs_to_file_only():
        ray_data.warning(f"{LAGGING_NO_CPU_WARNING}. The Dataset job will hang unless more CPUs are freed up.")
        ray_data.warning("a warning of Ray Data's")
        ray_data.info("an execution plan")
    ray_data.info("after preparing")
    printed = [line.split(" -- ", 1)[1] for line in ray_data_console.getvalue().splitlines()]
    assert printed == ["a warning of Ray Data's", "after preparing"]


@pytest.mark.cluster
def test_a_disk_that_fills_up_while_prepare_writes_is_one_line_and_left_as_it_was(corpus_dir, small_disk):
    """Before, 91 lines of a Ray task's traceback, the cause last."""
    filler = fill(small_disk, room=64 * 1024)
    out = small_disk / "prepared"
    command = [sys.executable, "-m", "train.data", "prepare", "--source", str(corpus_dir), "--out", str(out)]
    done = subprocess.run([*command, "--seq-len", "64"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    said = rf"error: preparing {out}: no space left on the disk holding {small_disk} \(\d+\.\d MiB free\)"
    assert re.fullmatch(said, last), last
    assert [path.name for path in small_disk.iterdir()] == [filler.name]  # the partial dataset deleted


@pytest.mark.cluster
def test_prepare_stopped_while_it_writes_says_so_and_keeps_none_of_it(corpus_dir, tmp_path):
    """SIGTERM (``kill``, ``ray job stop``) while the shards are written, as Ctrl-C: before, Ray's own handler
    ended the command with a stack dump and exit code 15."""
    out, log = tmp_path / "prepared", tmp_path / "prepare.log"
    command = [sys.executable, "-m", "train.data", "prepare", "--source", str(corpus_dir), "--out", str(out)]
    # Its staging folder is made as the writing starts.
    interrupt_when([*command, "--seq-len", "64"], log, lambda: any(tmp_path.glob("prepared.preparing-*")))
    lines = log.read_text().strip().splitlines()
    assert lines[-1] == "interrupted", "\n".join(lines[-30:])
    assert [path.name for path in tmp_path.iterdir()] == [log.name]  # nothing half-written, nor its staging


@pytest.mark.cluster
def test_a_directory_raywright_did_not_write_is_never_overwritten(ray_session, corpus_dir, tmp_path):
    mine = tmp_path / "mycorpus"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own notes")
    email = DataConfig(source=f"{corpus_dir}/email/**/*.py", val_fraction=0.2)
    with pytest.raises(ConfigError, match=f"^data.path: {mine} holds files that are not a prepared dataset"):
        prepare(email, str(mine), seq_len=32)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # The same through the CLI a user would type: one line, exit 2, and the notes stay.
    done = subprocess.run(
        [sys.executable, "-m", "train", "--set", f"data.path={mine}"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(f"config error: data.path: {mine}")
    assert (mine / "notes.txt").read_text() == "the user's own notes"
    (mine / "manifest.json").write_text("the user's own manifest, in no format of ours")
    with pytest.raises(ConfigError, match=f"^data.path: {mine} holds files that are not a prepared dataset"):
        prepare(email, str(mine), seq_len=32)
    assert sorted(p.name for p in mine.iterdir()) == ["manifest.json", "notes.txt"]
    # raywright's own dataset is replaced whole, and nothing is left beside it.
    out = tmp_path / "prepared"
    prepare(email, str(out), seq_len=32)
    prepare(email, str(out), seq_len=16)
    assert load_manifest(str(out)).seq_len == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mycorpus", "prepared"]


@pytest.mark.cluster
def test_a_node_local_copy_goes_when_its_dataset_is_deleted_or_prepared_again(tiny_dataset, tmp_path, monkeypatch):
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    kept, deleted, again, new = (
        shutil.copytree(tiny_dataset, tmp_path / name) for name in ("kept", "del", "again", "new")
    )
    reading = {path: load_split(str(path), "train") for path in (kept, deleted, again)}
    copies = node_tmp / "raywright-data"

    def built_from() -> list[str]:
        return sorted(json.loads((copy / COPY_SOURCE).read_text())["path"] for copy in copies.iterdir())

    assert built_from() == sorted(map(str, (kept, deleted, again)))
    shutil.rmtree(deleted)
    manifest = json.loads((again / "manifest.json").read_text())
    (again / "manifest.json").write_text(json.dumps({**manifest, "documents": manifest["documents"] + 1}))

    load_split(str(new), "train")  # building a copy drops the copies of the datasets that are gone, in the background

    wait_for_condition(lambda: built_from() == sorted(map(str, (kept, new))), timeout=30)
    assert np.array_equal(reading[deleted][:4], reading[kept][:4])  # a worker reading a dropped copy reads on
    assert np.array_equal(load_split(str(again), "train")[:], reading[kept][:])  # rebuilt for its new manifest
    assert built_from() == sorted(map(str, (kept, again, new)))


@pytest.mark.cluster
def test_a_copy_does_not_wait_for_a_dataset_whose_storage_does_not_answer(tiny_dataset, tmp_path, monkeypatch):
    """The drop of a gone dataset's copy asks each copied dataset's storage: one that does not answer (a bucket
    of an earlier job that cannot be reached, retried for seconds) must not hold up the copy a run waits for."""
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    silent, deleted, new = (shutil.copytree(tiny_dataset, tmp_path / name) for name in ("silent", "del", "new"))
    first_rows = load_split(str(silent), "train")[:4]
    load_split(str(deleted), "train")
    shutil.rmtree(deleted)
    (silent / "manifest.json").unlink()
    os.mkfifo(silent / "manifest.json")  # reading it blocks until something writes it, as storage not answering
    copies = node_tmp / "raywright-data"
    answered = threading.Event()

    def answer() -> None:  # with nothing readable: its copy stays
        answered.set()
        with open(silent / "manifest.json", "wb"):
            pass

    storage_answers_late = threading.Timer(60, answer)  # where the copy waited for it, it ends the wait
    storage_answers_late.start()
    assert np.array_equal(load_split(str(new), "train")[:4], first_rows)
    assert not answered.is_set(), "the copy waited for the storage of a dataset it does not copy"
    storage_answers_late.cancel()
    answer()
    wait_for_condition(lambda: len(list(copies.iterdir())) == 2, timeout=30)
    built_from = {json.loads((copy / COPY_SOURCE).read_text())["path"] for copy in copies.iterdir()}
    assert built_from == {str(silent), str(new)}


@pytest.mark.unit
def test_a_shard_damaged_inside_is_named_where_its_copy_fails(tmp_path, monkeypatch):
    """pyarrow's error for a damaged page ("Corrupt snappy compressed data") names no file: the copy's error does."""
    dataset, node_tmp = tmp_path / "dataset", tmp_path / "node-tmp"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    shard = dataset / write_a_prepared_dataset(dataset).train.shards[0]
    page = pq.read_metadata(shard).row_group(0).column(0).data_page_offset
    damaged = bytearray(shard.read_bytes())
    damaged[page + 60 : page + 80] = bytes(b ^ 0xFF for b in damaged[page + 60 : page + 80])  # its footer whole
    shard.write_bytes(bytes(damaged))
    with pytest.raises(OSError, match="^Corrupt snappy compressed data") as failed:
        load_split(str(dataset), "train")
    assert failed.value.__notes__ == [f"while copying {shard} to this node"]
    assert not list(node_tmp.glob("raywright-data/*/*.u16*"))  # nothing half-copied left on the node


@pytest.mark.cluster
def test_a_copy_cut_short_leaves_no_partial_file_on_the_node(tiny_dataset, tmp_path, monkeypatch):
    """A worker killed while it copies (its group restarted mid-start) and a copy that fails leave nothing
    behind: a partial copy is as large as the split, and every later try would add one beside it."""
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    dataset = shutil.copytree(tiny_dataset, tmp_path / "ds")
    stalled_copy = textwrap.dedent(f"""
        import tempfile, time
        import pyarrow.parquet as pq
        from train.node_copy import load_split
        tempfile.tempdir = {str(node_tmp)!r}
        read_batches = pq.ParquetFile.iter_batches
        def stall_after_the_first_batch(self, *args, **kwargs):  # storage that stops answering mid-copy
            for batch in read_batches(self, *args, **kwargs):
                yield batch
                time.sleep(3600)
        pq.ParquetFile.iter_batches = stall_after_the_first_batch
        load_split({str(dataset)!r}, "train")
    """)
    copier = subprocess.Popen([sys.executable, "-c", stalled_copy])
    copies = node_tmp / "raywright-data"
    ours = {".lock", COPY_SOURCE}

    def node_files() -> dict[str, int]:
        return {f.name: f.stat().st_size for f in copies.glob("*/*")}

    wait_for_condition(lambda: any(size for name, size in node_files().items() if name not in ours), timeout=60)
    copier.kill()
    copier.wait()

    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    (shard,) = load_manifest(str(dataset)).train.shards[-1:]
    (dataset / shard).write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=f"^{dataset / shard}: a shard of the prepared dataset that cannot be read"):
        load_split(str(dataset), "train")
    assert set(node_files()) == ours

    shutil.copy(f"{tiny_dataset}/{shard}", dataset / shard)
    assert np.array_equal(load_split(str(dataset), "train")[:], load_split(tiny_dataset, "train")[:])
    assert {name for name in node_files() if name.startswith("train")} == {"train.u16"}


@pytest.mark.cluster
def test_a_node_without_room_for_the_copy_is_told_so_before_it_copies(tiny_dataset, tmp_path, monkeypatch):
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    disk = shutil.disk_usage(node_tmp)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk._replace(free=100_000))  # a nearly full disk
    with pytest.raises(OSError, match=r"the train split of .+ needs [\d,.]+ MB on this node and .+ has 0.1 MB free"):
        load_split(tiny_dataset, "train")
    assert not list(node_tmp.glob("raywright-data/*/train*"))


@pytest.mark.cluster
def test_bad_sources_name_the_problem(ray_data_console, tmp_path):
    with pytest.raises(ConfigError, match="data.source: cannot read '/no/such/dir': no such file or directory"):
        list_source("/no/such/dir")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="matches no files"):
        list_source(f"{tmp_path}/*.parquet")
    with pytest.raises(ConfigError, match="data.text_column: no column 'body'"):
        prepare(DataConfig(source=str(tmp_path / "a.jsonl"), text_column="body"), str(tmp_path / "out"), 8)
    # Numbers are no text: read as bytes they were 5 zero bytes for 5, and the run trained on them.
    pq.write_table(pa.table({"body": list(range(100))}), tmp_path / "numbers.parquet")
    with pytest.raises(ConfigError, match=f"column 'body' of {tmp_path}/numbers.parquet holds int64, not text$"):
        prepare(DataConfig(source=str(tmp_path / "numbers.parquet"), text_column="body"), str(tmp_path / "out"), 8)
    # A line that is not JSON: the file and the row, not ~180 lines of Ray Data's failure (to its log only).
    lines = [json.dumps({"text": doc}) for doc in _documents(5)]
    (tmp_path / "bad" / "b.jsonl").parent.mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "bad" / "b.jsonl").write_text("\n".join([*lines[:2], '{"text": "unclosed', *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match=f"^data.source: {tmp_path}/bad/b.jsonl is not JSON Lines.* in row 2\\)$"):
        prepare(DataConfig(source=f"{tmp_path}/bad"), str(tmp_path / "out"), 8)
    assert ray_data_console.getvalue() == ""
    assert not (tmp_path / "out").exists()
    # One small file is one document, in one split: the other is empty, and the error says why.
    (tmp_path / "input.txt").write_text("To be, or not to be, that is the question.\n" * 60)
    empty_train = r"gives no train sequence of 33 tokens: 0 of its 1 documents are in train \("
    with pytest.raises(ConfigError, match=empty_train):
        prepare(DataConfig(source=str(tmp_path / "input.txt"), val_fraction=0.1), str(tmp_path / "out"), 32)
    assert not (tmp_path / "out").exists()


def _split_key(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


@pytest.mark.cluster
def test_a_corpus_of_one_file_or_a_few_files_trains_and_validates(ray_session, tmp_path, capsys):
    # One ~1.2 MB file, as a first try often is: 1 MiB pieces made it 2 documents, most often both in train.
    rng = random.Random(1)
    words = ["to", "be", "or", "not", "question", "is"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(30_000)]
    (tmp_path / "input.txt").write_text("\n".join(lines))
    manifest = prepare(DataConfig(source=str(tmp_path / "input.txt"), val_fraction=0.02), str(tmp_path / "one"), 64)
    assert MIN_DOCUMENTS <= manifest.documents <= MIN_DOCUMENTS + 1
    sequences = {split: manifest.split(split).sequences for split in ("train", "val")}
    assert 0 < sequences["val"] < 0.1 * sum(sequences.values())

    # A few documents, of which the hash puts none in val (or at another fraction, none in train): the split
    # takes the other's document nearest to it, with its copies, and says so.
    texts = [f"document {i}: " + "the quick brown fox. " * (i + 20) for i in range(40)]
    for val_fraction, empty, keep in ((0.02, "val", lambda key: key >= 0.02), (0.45, "train", lambda key: key < 0.45)):
        few = [text for text in texts if keep(_split_key(text))][:4]
        nearest = min(few, key=_split_key) if empty == "val" else max(few, key=_split_key)
        corpus = tmp_path / f"few-{empty}"
        corpus.mkdir()
        for i, text in enumerate([*few, nearest]):  # the last, a copy
            (corpus / f"doc{i}.txt").write_text(text)
        docs, sums = split_documents(str(corpus), val_fraction)
        rows = docs.take_all()
        in_empty = sorted(row["text"].decode() for row in rows if row["split"] == empty)
        assert in_empty == [nearest, nearest] and len(rows) == 5
        assert sums[empty]["documents"] == 2 and sums[empty]["num_bytes"] == 2 * len(nearest.encode())
        assert f"{empty}: the hash left it none of the 5 documents; it takes the nearest one" in capsys.readouterr().out
    # Copies of one text alone: there is nothing to share, and the error says which split the hash left empty.
    (tmp_path / "copies").mkdir()
    for i in range(3):
        (tmp_path / "copies" / f"doc{i}.txt").write_text(texts[0])
    empty = "val" if _split_key(texts[0]) >= 0.02 else "train"
    with pytest.raises(ConfigError, match=f"gives no {empty} sequence of 65 tokens: 0 of its 3 documents are in"):
        prepare(DataConfig(source=str(tmp_path / "copies"), val_fraction=0.02), str(tmp_path / "out-copies"), 64)
    assert "takes the nearest one" not in capsys.readouterr().out


@pytest.mark.unit
def test_a_source_of_few_documents_is_cut_into_smaller_pieces(tmp_path):
    fs = pafs.LocalFileSystem()
    (tmp_path / "one.txt").write_bytes(b"x\n" * 600_000)  # 1.2 MB: 2 pieces of 1 MiB, ~MIN_DOCUMENTS of these
    assert piece_bytes(fs, [str(tmp_path / "one.txt")]) == 1_200_000 // MIN_DOCUMENTS
    (tmp_path / "small.txt").write_bytes(b"x\n" * 100)
    assert piece_bytes(fs, [str(tmp_path / "small.txt")]) == MIN_PIECE_BYTES
    (tmp_path / "large.txt").write_bytes(b"x" * (MIN_DOCUMENTS * PIECE_BYTES))  # documents enough at 1 MiB
    assert piece_bytes(fs, [str(tmp_path / "large.txt")]) == PIECE_BYTES
    # As many files as documents wanted: their sizes are not asked (a request each on object storage).
    assert piece_bytes(fs, [f"{tmp_path}/absent{i}.txt" for i in range(MIN_DOCUMENTS)]) == PIECE_BYTES


@pytest.mark.cluster
def test_rows_without_text_are_skipped_as_if_they_were_not_there(ray_session, tmp_path, capsys):
    docs = _documents()
    pq.write_table(pa.table({"text": docs}), tmp_path / "all.parquet")
    pq.write_table(pa.table({"text": [*docs[:10], None, *docs[10:], None]}), tmp_path / "nulls.parquet")
    with open(tmp_path / "missing.jsonl", "w") as f:  # a line without the column
        f.writelines(json.dumps({"text": doc} if i != 7 else {"title": doc}) + "\n" for i, doc in enumerate(docs))
    whole = prepare(DataConfig(source=str(tmp_path / "all.parquet"), val_fraction=0.2), str(tmp_path / "all"), 32)
    assert "skipped" not in capsys.readouterr().out
    nulls = prepare(DataConfig(source=str(tmp_path / "nulls.parquet"), val_fraction=0.2), str(tmp_path / "nulls"), 32)
    assert f"skipped 2 of 62 rows of {tmp_path}/nulls.parquet: 'text' null or missing" in capsys.readouterr().out
    assert nulls.documents == whole.documents == 60
    assert nulls.source_sha256 == whole.source_sha256
    for split in ("train", "val"):
        assert np.array_equal(load_split(str(tmp_path / "nulls"), split), load_split(str(tmp_path / "all"), split))
    missing_text = DataConfig(source=str(tmp_path / "missing.jsonl"), val_fraction=0.2)
    missing = prepare(missing_text, str(tmp_path / "missing"), 32)
    assert "skipped 1 of 60 rows" in capsys.readouterr().out and missing.documents == 59
    # A project's directory: its text, and an image among it, which is not taken for text.
    (tmp_path / "project").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "project" / f"doc{i:02d}.txt").write_text(doc)
    (tmp_path / "project" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 40)
    project = prepare(DataConfig(source=str(tmp_path / "project"), val_fraction=0.2), str(tmp_path / "project-out"), 32)
    assert f"skipped 1 of the 61 files of {tmp_path}/project: not text (a NUL byte)" in capsys.readouterr().out
    assert project.documents == 60 and project.source_sha256 == whole.source_sha256
    # No text at all: one line naming the source, not a ZeroDivisionError where tokens per byte are counted.
    pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), tmp_path / "blank.parquet")
    for source, why in (("project/logo.png", "(skipped 1 of the 1 files"), ("blank.parquet", "(skipped 2 of 2 rows")):
        error = f"data.source: {tmp_path}/{source} holds no text to train on {why}"
        with pytest.raises(ConfigError, match=re.escape(error)):
            prepare(DataConfig(source=f"{tmp_path}/{source}"), str(tmp_path / "out"), 32)


@pytest.mark.unit
def test_a_source_leaves_out_installed_packages_bytecode_and_hidden_files_on_any_filesystem(tmp_path):
    """The default source is the stdlib directory, which holds site-packages: it is never read, nor listed. A
    project's directory holds .git/ (compressed objects) and such: not text to train on."""
    hidden = (".git/objects/ab/cdef", ".venv/lib/x.py", "json/.DS_Store", ".env")
    for name in ("json/decoder.py", "site-packages/torch/nn.py", "json/__pycache__/decoder.pyc", "README.txt", *hidden):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert list_source(f"{tmp_path}/**/*.py")[1] == [str(tmp_path / "json/decoder.py")]
    local = sorted(_files_below(pafs.LocalFileSystem(), str(tmp_path)))
    assert local == [str(tmp_path / "README.txt"), str(tmp_path / "json/decoder.py")]
    # Object storage is listed at once (a listing per folder would be a request each), then filtered alike.
    subtree = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    assert sorted(_files_below(subtree, "")) == ["README.txt", "json/decoder.py"]


@pytest.mark.unit
def test_sample_order_is_a_pure_function_of_seed_epoch_and_index():
    order, fresh = SampleOrder(10, seed=3), SampleOrder(10, seed=3)
    first_two_epochs = order.rows(range(0, 20))
    assert sorted(first_two_epochs[:10]) == list(range(10)) == sorted(first_two_epochs[10:])
    assert not np.array_equal(first_two_epochs[:10], first_two_epochs[10:])
    # Asking in another order, or from a fresh object, gives the same rows.
    assert np.array_equal(fresh.rows(range(15, 20)), first_two_epochs[15:20])
    assert np.array_equal(fresh.rows(range(0, 5)), first_two_epochs[0:5])
    assert not np.array_equal(SampleOrder(10, seed=4).rows(range(10)), first_two_epochs[:10])
    # The order runs have always had (a checkpoint's data position means the same rows), held in 32 bits.
    many = SampleOrder(100_003, seed=7)
    assert many.permutation(2).dtype == np.int32
    assert np.array_equal(many.permutation(2), np.random.default_rng([7, 2]).permutation(100_003))


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2, 3, 6])
def test_every_world_size_covers_each_global_batch_exactly_once(world_size):
    global_batch, micro = 12, 2
    accum = global_batch // (micro * world_size)
    for step in (0, 7):
        seen = [
            i
            for rank in range(world_size)
            for k in range(accum)
            for i in micro_batch_samples(step, k, rank, world_size, global_batch, micro)
        ]
        assert sorted(seen) == list(range(step * global_batch, (step + 1) * global_batch))


class _ShortReads:
    """A stream that returns at most 7 bytes a read, as a network or decompressing stream may."""

    def __init__(self, data: bytes):
        self.stream = pa.BufferReader(data)

    def read(self, size: int) -> bytes:
        return self.stream.read(min(size, 7))


@pytest.mark.unit
def test_a_text_file_larger_than_a_piece_is_read_as_pieces_cut_at_line_ends():
    rng = random.Random(0)
    text = b"".join(b"x" * rng.randint(0, 30) + b"\n" for _ in range(60)) + b"no line end at the end"
    for stream in (pa.BufferReader(text), _ShortReads(text)):
        pieces = list(text_pieces(stream, piece_bytes=64))
        assert b"".join(pieces) == text and len(pieces) > len(text) // 64
        assert all(0 < len(p) <= 64 and p.endswith(b"\n") for p in pieces[:-1])
    long_line = b"y" * 150 + b"\nend\n"  # longer than a piece: cut mid-line, where no line end is
    pieces = list(text_pieces(pa.BufferReader(long_line), piece_bytes=64))
    assert pieces == [b"y" * 64, b"y" * 64, b"y" * 22 + b"\nend\n"]
    assert list(text_pieces(pa.BufferReader(b"a\n" * 32), piece_bytes=64)) == [b"a\n" * 32]
    assert list(text_pieces(pa.BufferReader(b""), piece_bytes=64)) == [b""]  # an empty file: one empty document
    # Not text (an image, a compiled object): a NUL byte among the first 8,000, however the reads come; None, once.
    binary = b"x" * 7000 + b"\x00" + b"y" * 20_000
    for stream in (pa.BufferReader(binary), _ShortReads(binary)):
        assert list(text_pieces(stream, piece_bytes=PIECE_BYTES)) == [None]
    late_nul = b"x" * 8000 + b"\x00"  # as git, what comes later is not looked at
    assert list(text_pieces(pa.BufferReader(late_nul), piece_bytes=PIECE_BYTES)) == [late_nul]


@pytest.mark.cluster
def test_text_files_are_read_by_ray_data_as_documents_in_file_order(ray_session, tmp_path):
    files = {"a.txt": b"short\n", "b.txt": b"".join(b"line %d\n" % i for i in range(100)), "c.txt": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / name) for name in files]
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # as prepare reads
    rows = ray.data.read_datasource(TextFiles(paths, pafs.LocalFileSystem(), piece_bytes=100)).take_all()
    pieces = list(text_pieces(pa.BufferReader(files["b.txt"]), piece_bytes=100))
    assert [row["text"] for row in rows] == [files["a.txt"], *pieces, b""]

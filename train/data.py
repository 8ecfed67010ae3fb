"""Corpus -> tokenized fixed-length sequences in Parquet shards, with a manifest.

    python -m train.data prepare --source 'corpus/**/*.txt' --out data/mycorpus --seq-len 256

Ray Data reads and tokenizes the documents in parallel. Each document goes to the
train or validation split by a hash of its content (stable across runs and machines;
a split the hash leaves empty takes the other's nearest document), its tokens are
concatenated with an end-of-text token between documents, and the stream is cut into
sequences of ``seq_len + 1`` tokens (inputs plus shifted targets).
``manifest.json`` is written last: a dataset directory without it is incomplete.
"""

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import sys
import sysconfig
import uuid
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from train import storage
from train.cli import OneLineParser, one_line_errors, setting_type, take_sigterm_as_ctrl_c
from train.config import BPE_TRAIN_BYTES, DataConfig, TrainConfig, tokenizer_setting
from train.manifest import MANIFEST, SPLITS, Manifest, SplitShards, write_manifest
from train.model_config import ModelConfig
from train.schema import ConfigError, error_reason, parse
from train.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, save_tokenizer, train_bpe

TOKENS_PER_PACK = 1 << 24  # documents packed together: a block of ~32 MB of tokens
PREPARING = ".raywright-dataset"  # written first: a directory holding it is raywright's to replace
# The split of a row whose text is null (a JSON line without the column, a file that is not text): in neither split.
NO_TEXT = "none"
# The Arrow types of a text column (null: a column in which no row has text), dictionary-encoded or not.
TEXT_TYPES = (
    pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view,
    pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view, pa.types.is_null,
)  # fmt: skip
# Logged by Ray Data before an execution that starts right after another, as prepare's do: Ray's view of free CPUs
# lags the tasks that just ended (1 of 2 CPUs free right after, both 0.25 s later: measured), so it warns of a
# hang that does not come.
LAGGING_NO_CPU_WARNING = "Warning: The Ray cluster currently does not have any available CPUs"


def default_source() -> str:
    """The running interpreter's standard library source: ~30 MB of text on every machine."""
    return os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")


def list_source(source: str) -> tuple[pafs.FileSystem, list[str], str]:
    """The filesystem, sorted file paths and kind (text, jsonl or parquet) of a source spec.

    A source is a file, a directory (every file below it), or a glob (``*`` crosses directories).
    What cannot be read is a ConfigError naming data.source.
    """
    try:
        fs, files = _source_files(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.source: cannot read {source!r}: {error_reason(exc)}") from None
    if not files:
        raise ConfigError(f"data.source: {source!r} matches no files")
    kinds = {_kind(f) for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"data.source: {source!r} mixes file kinds {sorted(kinds)}; give one kind")
    return fs, sorted(files), kinds.pop()


def _source_files(source: str) -> tuple[pafs.FileSystem, list[str]]:
    fs, path = storage.resolve(source)
    is_glob = any(ch in path for ch in "*?[")
    base = path.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0] if is_glob else path
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError("no such file or directory")
    if info.type == pafs.FileType.File:
        return fs, [base]
    files = _files_below(fs, base)
    if is_glob:
        pattern = path.replace("**/", "*")
        files = [f for f in files if fnmatch.fnmatch(f, pattern)]
    return fs, files


# Installed packages sit under the stdlib directory (the default source) but are not the stdlib.
SKIPPED_DIRS = {"site-packages", "__pycache__"}


def _skipped(name: str) -> bool:
    """A hidden file or folder (``.git/``, ``.venv/``, ``.DS_Store``: a project's directory holds them, and a
    byte-level corpus would take their binary objects as text), or one of ``SKIPPED_DIRS``."""
    return name.startswith(".") or name in SKIPPED_DIRS


def _files_below(fs: pafs.FileSystem, base: str) -> list[str]:
    """Every file below the directory ``base``, none of them or of their folders ``_skipped``."""
    if isinstance(fs, pafs.LocalFileSystem):  # skipped as it walks: site-packages can hold 40x the stdlib's files
        files = []
        for folder, subfolders, names in os.walk(base):
            subfolders[:] = [d for d in subfolders if not _skipped(d)]
            paths = [os.path.join(folder, name) for name in names if not _skipped(name)]
            files += [path for path in paths if os.path.isfile(path)]
        return files
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))  # one listing, where each is a request
    return [
        i.path
        for i in infos
        if i.type == pafs.FileType.File and not any(_skipped(part) for part in i.path[len(base) :].split("/") if part)
    ]


# Read decompressed (Ray Data's readers go by the extension): `docs.jsonl.gz` is JSON Lines, `notes.txt.zst` text.
COMPRESSIONS = (".gz", ".bz2", ".br", ".zst", ".lz4", ".snappy")


def _kind(path: str) -> str:
    for compression in COMPRESSIONS:
        path = path.removesuffix(compression)
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    return "text"


def _read_documents(fs: pafs.FileSystem, files: list[str], kind: str, text_column: str):
    """A Ray Dataset with one row per document and a single column ``text`` (bytes or str)."""
    import ray.data

    if kind == "text":
        from train.text_files import TextFiles, piece_bytes

        return ray.data.read_datasource(TextFiles(files, filesystem=fs, piece_bytes=piece_bytes(fs, files)))
    if kind == "jsonl":
        ds = ray.data.read_json(files, filesystem=fs)  # pyarrow's reader takes one JSON object per line
    else:
        ds = ray.data.read_parquet(files, filesystem=fs)
    schema = ds.schema()
    if text_column not in schema.names:
        raise ConfigError(f"data.text_column: no column {text_column!r} in {files[0]}; columns: {schema.names}")
    column_type = schema.types[schema.names.index(text_column)]
    stored_type = column_type.value_type if pa.types.is_dictionary(column_type) else column_type  # pandas' category
    if not any(is_text(stored_type) for is_text in TEXT_TYPES):
        raise ConfigError(f"data.text_column: column {text_column!r} of {files[0]} holds {column_type}, not text")
    return ds.select_columns([text_column]).rename_columns({text_column: "text"})


def split_documents(source: str, val_fraction: float, text_column: str = "text"):
    """The documents of ``source`` as a materialized Ray Dataset: per document its ``text``, ``num_bytes``,
    ``digest`` (SHA-256), ``split`` and ``bpe_draw`` (``bpe_sample``'s); a row without text (a file that is not
    text) is in split ``NO_TEXT``, left out, and how many is said in one line. A split that the hash left empty gets
    a document (``_fill_an_empty_split``). Returned with its ``split_sums`` of ``num_bytes``, which its callers need
    too.
    """
    fs, files, kind = list_source(source)
    try:
        docs = (
            _read_documents(fs, files, kind, text_column)
            .map_batches(_split_documents, fn_kwargs={"val_fraction": val_fraction}, batch_format="numpy")
            .materialize()
        )
    except ConfigError:
        raise
    except ValueError:  # a parse error (a storage error is not: it is no reason to read the whole corpus again)
        if kind == "jsonl":  # Ray Data's error does not name the file, and its fallback parser misplaces the line
            _refuse_bad_json(fs, files)
        raise
    docs, sums = _fill_an_empty_split(docs, split_sums(docs, ["num_bytes"]))
    rows, documents = docs.count(), sum(split["documents"] for split in sums.values())
    if kind == "text":
        skipped = f"skipped {rows - documents:,} of the {len(files):,} files of {source}: not text (a NUL byte)"
    else:
        skipped = f"skipped {rows - documents:,} of {rows:,} rows of {source}: {text_column!r} null or missing"
    if not sum(split["num_bytes"] for split in sums.values()):
        reason = f" ({skipped})" if documents < rows else ""
        raise ConfigError(f"data.source: {source} holds no text to train on{reason}")
    if documents < rows:
        print(skipped)
    return docs, sums


def _refuse_bad_json(fs: pafs.FileSystem, files: list[str]) -> None:
    """A ConfigError naming the first of ``files`` that is not JSON Lines, and pyarrow's account of where."""
    for path in files:
        try:
            with fs.open_input_stream(path) as stream:
                for _ in pa_json.open_json(stream):
                    pass
        except pa.ArrowInvalid as exc:
            raise ConfigError(f"data.source: {path} is not JSON Lines, one object per line ({exc})") from None


def _fill_an_empty_split(docs, sums: dict[str, dict[str, int]]):
    """``docs`` and their ``sums``, or where the hash left a split empty and the other holds two different texts or
    more, ``docs`` with the other's document nearest the boundary between them (the train document of the lowest
    key, or the val document of the highest) moved over, copies of it included: no text is in both splits.

    A corpus of a few documents then trains and validates: 40 files hold no val document 44% of the time at
    ``data.val_fraction`` 0.02. The split stays a function of the corpus alone.
    """
    documents = {split: sums[split]["documents"] for split in SPLITS}
    if documents["val"] == 0 and documents["train"] >= 2:
        taken_from, moved_to, nearest = "train", "val", min
    elif documents["train"] == 0 and documents["val"] >= 2:
        taken_from, moved_to, nearest = "val", "train", max
    else:
        return docs, sums
    ends = docs.select_columns(["split", "digest"]).map_batches(
        _split_ends, fn_kwargs={"split": taken_from, "nearest": nearest}, batch_size=None, batch_format="numpy"
    )
    # Python ints and the builtin: numpy would turn a list of keys of 2**63 and over into float64 (not exact).
    key = nearest(int(row["key"]) for row in ends.iter_rows())
    moved = docs.map_batches(_move_document, fn_kwargs={"key": key, "to": moved_to}, batch_format="numpy")
    moved = moved.materialize()
    moved_sums = split_sums(moved, ["num_bytes"])
    if moved_sums[taken_from]["documents"] == 0:  # copies of one text, all: moved, they would empty the other split
        return docs, sums
    print(f"{moved_to}: the hash left it none of the {sum(documents.values())} documents; it takes the nearest one")
    return moved, moved_sums


def _digest_words(digests) -> np.ndarray:
    """Each SHA-256 digest as four big-endian numbers in [0, 2**64): the first chooses the document's split (its
    split key), the second its draw for a BPE's sample, apart from the split."""
    return np.frombuffer(b"".join(digests), dtype=">u8").reshape(-1, 4)


def _split_ends(batch: dict, split: str, nearest) -> dict:
    """The ``nearest`` (min or max) split key of the block's documents in ``split``, if it holds any."""
    keys = _digest_words(batch["digest"])[:, 0][batch["split"] == split]
    return {"key": np.array([nearest(keys)] if len(keys) else [], np.uint64)}


def _move_document(batch: dict, key: int, to: str) -> dict:
    moving = (_digest_words(batch["digest"])[:, 0] == key) & (batch["split"] != NO_TEXT)
    batch["split"] = np.where(moving, to, batch["split"])
    return batch


def _split_documents(batch: dict, val_fraction: float) -> dict:
    """Per document: its bytes and their count, its content digest, its split and its draw for a BPE's sample."""
    texts, digests = [], []
    for text in batch["text"]:
        data = b"" if text is None else text.encode("utf-8") if isinstance(text, str) else bytes(text)
        texts.append(data)
        # A row without text is kept, to be counted: a digest of zeros adds nothing to the corpus' fingerprint.
        digests.append(bytes(32) if text is None else hashlib.sha256(data).digest())
    has_text = np.array([text is not None for text in batch["text"]], dtype=bool)
    numbers = _digest_words(digests)[:, :2] / 2**64  # uniform in [0, 1)
    splits = np.where(~has_text, NO_TEXT, np.where(numbers[:, 0] < val_fraction, "val", "train"))
    draws = np.where(has_text, numbers[:, 1], 1.0)
    num_bytes = [len(text) for text in texts]
    return {"text": texts, "num_bytes": num_bytes, "digest": digests, "split": splits, "bpe_draw": draws}


def _tokenize(batch: dict, tokenizer: BPETokenizer) -> dict:
    """Per document: its tokens followed by end-of-text, and its size in bytes."""
    # One thread, as the one CPU Ray Data gave the task: a batch call would otherwise take every core of the node.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    encoded = tokenizer.encode_batch([bytes(text) for text in batch["text"]])
    tokens = [np.append(ids, tokenizer.eot_id).astype(np.uint16) for ids in encoded]
    return {
        "split": batch["split"],
        "tokens": [t.tobytes() for t in tokens],
        "num_tokens": [len(t) for t in tokens],
        "num_bytes": batch["num_bytes"],
    }


def _pack(batch: dict, seq_len: int) -> pa.Table:
    """Concatenate the documents of a batch and cut them into rows of seq_len + 1 tokens."""
    stream = np.frombuffer(b"".join(batch["tokens"]), dtype=np.uint16)
    rows = len(stream) // (seq_len + 1)
    flat = pa.array(stream[: rows * (seq_len + 1)], type=pa.uint16())
    return pa.table({"tokens": pa.FixedSizeListArray.from_arrays(flat, seq_len + 1)})


def make_tokenizer(choice: str, vocab_size: int, docs, train_bytes: int, bpe_train_bytes: int) -> BPETokenizer:
    """``data.tokenizer``: ``byte``, ``bpe`` (trained here on the training split of ``docs``, ``train_bytes`` long,
    or on a sample of about ``bpe_train_bytes`` of it where it holds more; 0: all of it), or a path."""
    if choice == "byte":
        return ByteTokenizer()
    if choice == "bpe":
        texts = (
            bytes(text).decode("utf-8", errors="replace")
            for batch in bpe_sample(docs, train_bytes, bpe_train_bytes).iter_batches(batch_format="numpy")
            for text in batch["text"]
        )
        return train_bpe(texts, vocab_size)
    return load_tokenizer(choice)


def bpe_sample(docs, train_bytes: int, at_most_bytes: int):
    """The documents (of ``split_documents``) that a BPE trains on: the training split (``train_bytes`` long), or
    where it holds more than ``at_most_bytes`` (0: no limit), an even sample of about that many bytes of it, said in
    one line."""
    from ray.data.expressions import col

    training = col("split") == "train"
    if not 0 < at_most_bytes < train_bytes:
        return docs.filter(expr=training)
    print(
        f"training the BPE on ~{at_most_bytes / 1e6:,.1f} MB of the training split's {train_bytes / 1e6:,.1f} MB "
        "(data.bpe_train_bytes)",
        flush=True,
    )
    # Each document in or out by its hash: the same sample of the same corpus on any machine.
    return docs.filter(expr=training & (col("bpe_draw") < at_most_bytes / train_bytes))


@contextlib.contextmanager
def _ray_data_logs_to_file_only() -> Iterator[None]:
    """Ray Data's execution plans and progress (~60 lines for the five executions of ``prepare``) go to its log
    file (``logs/ray-data/ray-data.log`` in the Ray session) and not to the console, which keeps Ray Data's
    warnings less ``LAGGING_NO_CPU_WARNING``. Its errors go to the file only too: each reaches the caller as the
    exception that stopped the execution (a bad JSON line printed ~180 lines before it). Progress bars on an
    interactive terminal are not logs: they stay."""
    consoles = [
        handler
        for handler in logging.getLogger("ray.data").handlers
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
    ]
    levels = [handler.level for handler in consoles]

    def warning_for_the_console(record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR and not record.getMessage().startswith(LAGGING_NO_CPU_WARNING)

    for handler in consoles:
        handler.setLevel(max(handler.level, logging.WARNING))
        handler.addFilter(warning_for_the_console)
    try:
        yield
    finally:
        for handler, level in zip(consoles, levels, strict=True):
            handler.setLevel(level)
            handler.removeFilter(warning_for_the_console)


def prepare(data: DataConfig, out: str, seq_len: int, out_setting: str = "--out") -> Manifest:
    """Tokenize ``data.source`` into sequences of ``seq_len + 1`` tokens in Parquet shards under ``out`` (not
    ``data.path``, which may be left to a run to derive) and return the manifest. The tokenizer, as ``data``
    chooses it, is stored in ``out/tokenizer.json``. ``out_setting`` names ``out`` in errors.
    """
    import ray.data

    from train.shared_storage import check_nodes_share

    refuse_foreign(out)  # before any work: a user's directory is never touched
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # reproducible shards
    source = data.source or default_source()
    with _ray_data_logs_to_file_only():
        docs, sums = split_documents(source, data.val_fraction, data.text_column)
        documents = sum(split["documents"] for split in sums.values())
        source_sha256 = fingerprint(docs)
        train_bytes = sums["train"]["num_bytes"]
        chosen = make_tokenizer(data.tokenizer, data.vocab_size, docs, train_bytes, data.bpe_train_bytes)
        tokens = docs.map_batches(_tokenize, fn_kwargs={"tokenizer": chosen}, batch_format="numpy").materialize()
        # Asked again now that the nodes writing the shards are up, those an autoscaler added for this work too.
        check_nodes_share([(out_setting, out)])
        # Locally the dataset is written to a sibling and renamed into place, so an interrupted or concurrent
        # preparation never leaves a half-written one at ``out``; object storage has no rename: written in place.
        staging = f"{out.rstrip('/')}.preparing-{uuid.uuid4().hex[:8]}" if storage.is_local(out) else out
        if staging == out and storage.exists(out):
            storage.delete_dir(out)  # raywright's own (checked above): a rerun replaces it whole
        try:
            tokens_per_byte, splits = _write_dataset(staging, tokens, chosen, seq_len, source)
        except BaseException as exc:
            if staging != out and storage.exists(staging):
                storage.delete_dir(staging)
            full = storage.disk_full(exc, f"preparing {out}", staging) if storage.is_local(out) else None
            if full:
                raise full from None
            raise
    manifest = Manifest(
        source=source,
        source_sha256=source_sha256,
        documents=documents,
        val_fraction=data.val_fraction,
        tokenizer=chosen.spec(),
        tokens_per_byte=tokens_per_byte,
        seq_len=seq_len,
        **splits,
    )
    write_manifest(staging, manifest)  # last: it makes the dataset complete
    if staging != out:
        refuse_foreign(out)  # again: something may have appeared there meanwhile
        if storage.exists(out):
            storage.delete_dir(out)
        out_fs, out_path = storage.resolve(out)
        out_fs.move(storage.resolve(staging)[1], out_path)
    return manifest


def refuse_foreign(out: str) -> None:
    """Refuse an ``out`` that holds files raywright did not write (no manifest, no preparation marker)."""
    if not storage.exists(out) or not storage.list_dir(out):
        return
    if storage.exists(storage.join(out, PREPARING)):
        return  # a preparation of ours that did not finish
    try:  # an older version's manifest is ours to prepare again; one that is not JSON says nothing of whose it is
        manifest = storage.read_json_if_exists(storage.join(out, MANIFEST))
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or not {"seq_len", "tokenizer", "train"} <= manifest.keys():
        raise ConfigError(
            f"data.path: {out} holds files that are not a prepared dataset (no {MANIFEST}); "
            "raywright never overwrites them: give a new or empty directory (data.source is the corpus)"
        )


def fingerprint(docs) -> str:
    """The SHA-256 of the sum of the documents' digests as 256-bit numbers (of ``split_documents``' documents).

    A sum is the same for the same documents in any order, file layout or blocking, and each block sums its own:
    no digest comes to the driver, where one per document would take gigabytes at 100M documents. (A sum can be
    matched on purpose; it names a corpus, it does not guard one.)
    """
    sums = docs.select_columns(["digest"]).map_batches(_digest_sum, batch_size=None, batch_format="numpy")
    total = sum(int.from_bytes(row["digest_sum"]) for row in sums.iter_rows()) % 2**256
    return hashlib.sha256(total.to_bytes(32)).hexdigest()


def _digest_sum(batch: dict) -> dict:
    # Eight 32-bit limbs per digest, summed per limb in 64 bits: exact for up to 2**32 documents in a block.
    limbs = np.frombuffer(b"".join(batch["digest"]), dtype=">u4").reshape(-1, 8).astype(np.uint64).sum(axis=0)
    total = sum(int(limb) << (32 * (7 - i)) for i, limb in enumerate(limbs)) % 2**256
    return {"digest_sum": [total.to_bytes(32)]}


def split_sums(ds, columns: list[str]) -> dict[str, dict[str, int]]:
    """Per split, how many documents ``ds`` holds and the sum of each of these integer columns over them.

    Each block sums its own documents, so a few numbers per block come to the driver, however many documents
    there are. (Ray Data's aggregations would take a hash shuffle each: ~8 s.) Only the columns summed are read:
    a batch of all of them would copy every document's text into a numpy array.
    """
    counted = ds.select_columns(["split", *columns])
    sums = counted.map_batches(_block_sums, fn_kwargs={"columns": columns}, batch_size=None, batch_format="numpy")
    totals = {split: dict.fromkeys(["documents", *columns], 0) for split in SPLITS}
    for row in sums.iter_rows():
        for name in totals[row["split"]]:
            totals[row["split"]][name] += int(row[name])
    return totals


def _block_sums(batch: dict, columns: list[str]) -> dict:
    rows = {"split": list(SPLITS), "documents": [], **{name: [] for name in columns}}
    for split in SPLITS:
        chosen = batch["split"] == split
        rows["documents"].append(int(chosen.sum()))
        for name in columns:
            rows[name].append(int(batch[name][chosen].sum()))
    return rows


def _write_dataset(
    out: str, tokens, tokenizer: BPETokenizer, seq_len: int, source: str
) -> tuple[float, dict[str, SplitShards]]:
    """Shards of both splits and the tokenizer under ``out``; the tokens per byte and the splits' shards (the
    manifest is written by the caller)."""
    from ray.data.expressions import col

    storage.write_bytes(storage.join(out, PREPARING), b"")  # marks the directory as raywright's from the start
    out_fs, out_path = storage.resolve(out)
    save_tokenizer(tokenizer, out)
    sums = split_sums(tokens, ["num_tokens", "num_bytes"])
    tokens_per_byte = sum(s["num_tokens"] for s in sums.values()) / sum(s["num_bytes"] for s in sums.values())
    splits = {}
    for split in SPLITS:
        documents = tokens.filter(expr=col("split") == split)
        # Each group of documents is packed on its own (its last partial sequence dropped). The groups are fixed
        # by the documents alone, not by how Ray Data blocked them on this cluster, so the same corpus gives the
        # same sequences on any machine.
        groups = max(1, -(-sums[split]["num_tokens"] // TOKENS_PER_PACK))
        packed = documents.repartition(groups, shuffle=False).map_batches(
            _pack, fn_kwargs={"seq_len": seq_len}, batch_size=None, batch_format="numpy"
        )
        packed.write_parquet(f"{out_path}/{split}", filesystem=out_fs)
        shards = [f"{split}/{name}" for name in storage.list_dir(storage.join(out, split))]
        sequences = sum(pq.read_metadata(f"{out_path}/{s}", filesystem=out_fs).num_rows for s in shards)
        splits[split] = SplitShards(shards=shards, sequences=sequences)
        if sequences == 0:
            raise ConfigError(
                f"data.source: {source!r} gives no {split} sequence of {seq_len + 1} tokens: "
                f"{sums[split]['documents']} of its {sum(s['documents'] for s in sums.values())} documents are in "
                f"{split} ({sums[split]['num_tokens']} tokens; a document's split comes from its hash, and each split "
                "gets one where there are two different texts): give more text or files, or change data.val_fraction"
            )
    return tokens_per_byte, splits


def dataset_path(cfg: TrainConfig) -> str:
    """``data.path``, or a directory under the storage path named by the preparation settings."""
    data = cfg.data
    if data.path:
        return data.path
    tokenizer = [data.tokenizer]
    if data.tokenizer == "bpe":
        tokenizer.append(data.vocab_size)
        if data.bpe_train_bytes != BPE_TRAIN_BYTES:  # the datasets prepared before the setting keep their names
            tokenizer.append(data.bpe_train_bytes)
    settings = json.dumps([data.source, data.text_column, data.val_fraction, *tokenizer, cfg.model.seq_len])
    return storage.join(cfg.run.storage_path, "datasets", hashlib.sha256(settings.encode()).hexdigest()[:12])


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m train.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    prep = sub.add_parser("prepare", help="tokenize a corpus into Parquet shards")
    # The flags are settings of a recipe and refuse what --set refuses.
    prep.add_argument("--source", default="", help="file, directory or glob; local or URI (default: Python stdlib)")
    prep.add_argument("--out", required=True, help="output directory (local or URI)")
    prep.add_argument(
        "--seq-len", type=setting_type(ModelConfig, "seq_len"), default=256, help="model.seq_len of the runs to train"
    )
    prep.add_argument(
        "--val-fraction", type=setting_type(DataConfig, "val_fraction"), default=0.02, help="share held out, < 0.5"
    )
    prep.add_argument("--text-column", default="text", help="column holding the text in JSONL/Parquet")
    prep.add_argument("--tokenizer", default="byte", help="byte, bpe (trained on the source), or a tokenizer path")
    prep.add_argument(
        "--vocab-size", type=setting_type(DataConfig, "vocab_size"), default=4096, help="vocabulary of a trained BPE"
    )
    prep.add_argument(
        "--bpe-train-bytes",
        type=setting_type(DataConfig, "bpe_train_bytes"),
        default=BPE_TRAIN_BYTES,
        help="a trained BPE learns from at most this many bytes of the training split, sampled evenly (0: all)",
    )
    args = parser.parse_args(argv)
    settings = ("source", "text_column", "val_fraction", "tokenizer", "vocab_size", "bpe_train_bytes")
    data = parse(DataConfig, {name: getattr(args, name) for name in settings})
    # Before Ray starts: what would otherwise fail after it, or after the corpus is read.
    try:
        refuse_foreign(args.out)
    except OSError as exc:  # storage that cannot be reached
        raise ConfigError(f"--out: cannot use {args.out}: {error_reason(exc)}") from None
    list_source(data.source or default_source())
    if data.tokenizer != "bpe":
        tokenizer_setting(data.tokenizer, "--tokenizer")
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    take_sigterm_as_ctrl_c()  # stopped, it keeps none of what it wrote
    manifest = prepare(data, args.out, args.seq_len)
    print(
        f"prepared {manifest.train.sequences} train and {manifest.val.sequences} validation "
        f"sequences of {args.seq_len + 1} tokens from {manifest.documents} documents into {args.out} "
        f"({manifest.tokens_per_byte:.3f} tokens per byte)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

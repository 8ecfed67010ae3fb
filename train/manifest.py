"""A prepared dataset's manifest: what ``prepare`` made, read by every step after it.

``prepare`` writes it last, so a dataset directory without one is incomplete. The checks before a run, the
workers and the node-local copies read it; a checkpoint records its SHA-256 as the identity of the data.
"""

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from train import storage
from train.schema import ConfigError, Section, read_record
from train.tokenizer import TokenizerSpec

MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class SplitShards(Section):
    """One split of a prepared dataset."""

    shards: list[str]  # Parquet files, relative to the dataset, in order
    sequences: int  # rows of seq_len + 1 tokens, over all of them


class Manifest(Section):
    """What ``prepare`` made of a corpus: its shards per split, its tokenizer, and the corpus's identity."""

    source: str  # the corpus
    source_sha256: str  # of its documents' own, in any order (``data.fingerprint``)
    documents: int  # with text: null rows are in neither split
    val_fraction: float
    tokenizer: TokenizerSpec  # its file is tokenizer.json beside the manifest
    tokens_per_byte: float  # end-of-text tokens included: what a loss per token is multiplied by for bits per byte
    seq_len: int
    train: SplitShards
    val: SplitShards

    def split(self, name: str) -> SplitShards:
        """The split called ``name`` (one of ``SPLITS``)."""
        return {"train": self.train, "val": self.val}[name]

    @property
    def sha256(self) -> str:
        """The identity of the prepared dataset, as checkpoints record it."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()


def load_manifest(path: str) -> Manifest | None:
    """The manifest of the dataset at ``path``, or None if it holds no complete preparation."""
    try:
        return read_record(Manifest, storage.join(path, MANIFEST), "a manifest")
    except ConfigError as unreadable:
        raise ConfigError(f"data.path: {unreadable}: prepare the dataset again") from None


def prepared_manifest(path: str) -> Manifest:
    """The manifest of the dataset at ``path``, which must be complete."""
    manifest = load_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"data.path: {path!r} has no {MANIFEST}; run `python -m train.data prepare`")
    return manifest


def write_manifest(path: str, manifest: Manifest) -> None:
    """Write the manifest of the dataset at ``path``: the last file of a preparation, which makes it complete."""
    storage.write_json(storage.join(path, MANIFEST), manifest.model_dump())


def _prepare_again(path: str) -> str:
    return f"prepare the dataset again (delete {path}, or give another data.path)"


def unreadable_shard(path: str, shard: str, why: str) -> str:
    """How a shard of the dataset at ``path`` that cannot be read as ``prepare`` wrote it is reported."""
    where = storage.join(path, shard)
    return f"{where}: a shard of the prepared dataset that cannot be read ({why}); {_prepare_again(path)}"


def check_shards(path: str, manifest: Manifest) -> None:
    """Raise ConfigError where a shard the manifest lists is not there or is not Parquet with a ``tokens`` column,
    or where a split's shards hold other than the sequences the manifest counts (a shard deleted, cut short or
    replaced since ``prepare``).

    Found before a run, that is one line; found by the workers, every attempt fails alike and Ray Train retries it
    ``scaling.max_failures`` times (42 s and pages of tracebacks for the tiny recipe). Only each shard's footer
    is read, all at once: on object storage each is a request or two.
    """
    fs, root = storage.resolve(path)

    def rows(shard: str) -> int:
        def damaged(why: str) -> ConfigError:
            return ConfigError(f"data.path: {unreadable_shard(path, shard, why)}")

        try:
            footer = pq.read_metadata(f"{root}/{shard}", filesystem=fs)
        except FileNotFoundError:
            raise damaged("it is not there") from None
        except pa.ArrowInvalid as exc:
            raise damaged(str(exc)) from None
        columns = footer.schema.to_arrow_schema().names
        if "tokens" not in columns:
            raise damaged(f"no tokens column, only {columns}")
        return footer.num_rows

    with ThreadPoolExecutor(16) as pool:
        for split in SPLITS:
            listed = manifest.split(split)
            held = sum(pool.map(rows, listed.shards))
            if held != listed.sequences:
                raise ConfigError(
                    f"data.path: the {split} shards of {path} hold {held} sequences, its {MANIFEST} counts "
                    f"{listed.sequences}; {_prepare_again(path)}"
                )

"""A prepared dataset's manifest: what ``prepare`` made, read by every step after it.

``prepare`` writes it last, so a dataset directory without one is incomplete. The checks before a run, the
workers and the node-local copies read it; a checkpoint records its SHA-256 as the identity of the data.
"""

import hashlib
import json

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

import hashlib
import json

import pytest

from train.manifest import Manifest, SplitShards, load_manifest, write_manifest
from train.schema import ConfigError
from train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit


def a_manifest() -> Manifest:
    return Manifest(
        source="corpus/**/*.txt",
        source_sha256="ab" * 32,
        documents=40,
        val_fraction=0.02,
        tokenizer=ByteTokenizer().spec(),
        tokens_per_byte=1.0010673782521682,
        seq_len=128,
        train=SplitShards(shards=["train/0.parquet", "train/1.parquet"], sequences=283),
        val=SplitShards(shards=["val/0.parquet"], sequences=7),
    )


def test_a_manifest_reads_back_as_written_and_keeps_the_identity_checkpoints_recorded(tmp_path):
    manifest = a_manifest()
    write_manifest(str(tmp_path), manifest)
    assert load_manifest(str(tmp_path)) == manifest
    # The identity checkpoints have recorded since the first release: the SHA-256 of the file's JSON, keys sorted.
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest.sha256 == hashlib.sha256(json.dumps(written, sort_keys=True).encode()).hexdigest()
    assert manifest.split("val") == manifest.val and manifest.split("train").sequences == 283


def test_no_manifest_is_an_incomplete_dataset_and_a_damaged_one_an_error_naming_its_field(tmp_path):
    assert load_manifest(str(tmp_path)) is None
    values = a_manifest().model_dump()
    for damaged, field in [
        ({**values, "seq_len": "128"}, "seq_len"),
        ({**values, "train": {"shards": "train/0.parquet", "sequences": 283}}, "train.shards"),
        ({key: value for key, value in values.items() if key != "documents"}, "documents"),
    ]:
        (tmp_path / "manifest.json").write_text(json.dumps(damaged))
        with pytest.raises(ConfigError, match=rf"^data.path: {tmp_path}/manifest.json is not a manifest .*\({field}:"):
            load_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps(values)[:-9])  # a copy cut short
    with pytest.raises(ConfigError, match=r"manifest.json is not a manifest this raywright reads \(not JSON: .*again$"):
        load_manifest(str(tmp_path))

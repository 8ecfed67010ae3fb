import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import a_manifest, write_a_prepared_dataset
from train.manifest import check_shards, load_manifest, write_manifest
from train.schema import ConfigError

pytestmark = pytest.mark.unit


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


def test_shards_deleted_cut_short_or_replaced_since_prepare_are_named_before_a_run(tmp_path):
    """What the checks before a run find, in one line, rather than each worker's attempt failing alike."""
    manifest = write_a_prepared_dataset(tmp_path)
    check_shards(str(tmp_path), manifest)  # whole: nothing to say
    cut = tmp_path / "train" / "1.parquet"
    whole = cut.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    named = rf"^data.path: {cut}: a shard of the prepared dataset that cannot be read"
    again = rf"; prepare the dataset again \(delete {tmp_path}, or give another data.path\)$"
    with pytest.raises(ConfigError, match=rf"{named} \(Parquet magic bytes not found .*\){again}"):
        check_shards(str(tmp_path), manifest)
    cut.unlink()
    with pytest.raises(ConfigError, match=rf"{named} \(it is not there\){again}"):
        check_shards(str(tmp_path), manifest)
    pq.write_table(pa.table({"text": ["a"] * 83}), cut)  # another Parquet file in its place
    with pytest.raises(ConfigError, match=rf"{named} \(no tokens column, only \['text'\]\){again}"):
        check_shards(str(tmp_path), manifest)
    pq.write_table(pq.read_table(tmp_path / "val" / "0.parquet"), cut)  # the shard of another preparation
    counted = rf"^data.path: the train shards of {tmp_path} hold 207 sequences, its manifest.json counts 283{again}"
    with pytest.raises(ConfigError, match=counted):
        check_shards(str(tmp_path), manifest)
    cut.write_bytes(whole)
    check_shards(str(tmp_path), manifest)

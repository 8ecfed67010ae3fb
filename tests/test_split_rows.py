import numpy as np
import pytest

from train.split_rows import SplitRows

pytestmark = pytest.mark.unit


def test_rows_read_from_the_file_equal_the_array_they_were_written_from(tmp_path):
    array = np.random.default_rng(0).integers(0, 2**16, size=(50, 9), dtype=np.uint16)
    path = tmp_path / "train.u16"
    path.write_bytes(array.tobytes())
    rows = SplitRows(str(path), width=9)
    assert len(rows) == 50 and rows.shape == (50, 9)
    picks = np.array([49, 0, 7, 7, -1])
    assert np.array_equal(rows[picks], array[picks])  # a step's scattered rows, repeats included
    assert np.array_equal(rows[3], array[3]) and np.array_equal(rows[-2], array[-2])
    assert np.array_equal(rows[10:20], array[10:20]) and np.array_equal(rows[1:9:3], array[1:9:3])
    assert np.array_equal(rows[:1000], array) and rows[60:].shape == (0, 9)
    assert np.array_equal(np.asarray(rows), array)
    with pytest.raises(IndexError):
        rows[np.array([50])]


def test_a_file_that_is_not_whole_rows_is_refused(tmp_path):
    path = tmp_path / "cut.u16"
    path.write_bytes(b"\0" * 17)
    with pytest.raises(ValueError, match="not a whole number of 4-token rows"):
        SplitRows(str(path), width=4)

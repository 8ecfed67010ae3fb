"""Random access to the sequences of a prepared split, without holding the split in memory.

The split is one flat file of uint16 tokens, ``seq_len + 1`` per row. Rows are read with ``pread``
into fresh arrays: a worker's memory holds the rows of its current step, whatever the dataset's size
(a memory map would keep every page a step ever touched resident, and a whole-split array all of them).
"""

import os

import numpy as np


class SplitRows:
    """The rows of a split file; indexed like a (rows, width) array by an int, a slice or an array of ints."""

    def __init__(self, path: str, width: int):
        self.path = path
        self.width = width
        self._row_bytes = 2 * width
        size = os.path.getsize(path)
        if size % self._row_bytes:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {width}-token rows")
        self._rows = size // self._row_bytes
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self._rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self._rows, self.width)

    def __getitem__(self, index: int | slice | np.ndarray | list[int]) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, stride = index.indices(self._rows)
            if stride == 1:  # one read for a contiguous block
                return self._read(start, max(stop - start, 0))
            index = np.arange(start, stop, stride)
        if isinstance(index, int | np.integer):
            if not -self._rows <= index < self._rows:
                raise IndexError(f"row {index} of {self._rows}")
            return self._read(int(index) % self._rows, 1)[0]
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < -self._rows or rows.max() >= self._rows):
            raise IndexError(f"rows outside 0..{self._rows - 1}")
        out = np.empty((len(rows), self.width), dtype=np.uint16)
        for i, row in enumerate(rows % max(self._rows, 1)):
            self._read_into(out[i], int(row))
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def _read(self, start: int, count: int) -> np.ndarray:
        out = np.empty((count, self.width), dtype=np.uint16)
        if count:
            self._read_into(out, start)
        return out

    def _read_into(self, out: np.ndarray, row: int) -> None:
        view = memoryview(out).cast("B")
        if os.preadv(self._fd, [view], row * self._row_bytes) != len(view):
            raise OSError(f"{self.path}: short read at row {row}")

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

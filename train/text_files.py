"""Text files as documents for Ray Data, read a piece at a time.

A file is one document; a file larger than ``PIECE_BYTES`` is several, each cut after the last line end of
its piece. Read whole, a 2.3 GB file took one task 19 GB to tokenize, Ray killed it for memory, and retried it
for ever; and as one document it went whole to one split, leaving the other empty. Pieces of 1 MiB split a
large file as finely as ``data.val_fraction`` asks, cost an end-of-text token per MiB, and leave every file of
the default corpus (the largest 0.76 MB) whole. A source of too few files for that (one 1 MB file, as a first
try often is) is cut finer: see ``piece_bytes``. Ray Data's file reader underneath sizes and schedules the read
tasks as ``read_binary_files`` does.

A file that is not text (an image, a PDF, a compiled object in a project's directory) is one document of no
text, which ``train.data`` counts and leaves out: a byte-level model would learn its bytes as the corpus.
"""

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
from ray.data.datasource import FileBasedDatasource

PIECE_BYTES = 1 << 20
# A source of fewer documents is cut into about this many: a split gets one document at least (``train.data``),
# which is then ~3% of the text or less.
MIN_DOCUMENTS = 32
MIN_PIECE_BYTES = 4096  # an end-of-text token every 4 KiB at most
BINARY_SNIFF_BYTES = 8000  # git's test of a binary file: a NUL byte among its first 8,000


def piece_bytes(fs: pafs.FileSystem, files: list[str]) -> int:
    """``PIECE_BYTES``, or for files that pieces of that size would make fewer than ``MIN_DOCUMENTS`` documents,
    the size that cuts them into about that many (not under ``MIN_PIECE_BYTES``): as one or two documents, a
    corpus would go to one split or the other nearly whole."""
    if len(files) >= MIN_DOCUMENTS:
        return PIECE_BYTES  # a document a file at least: no file's size need be asked (a request each on S3)
    sizes = [info.size for info in fs.get_file_info(files)]
    if sum(max(1, -(-size // PIECE_BYTES)) for size in sizes) >= MIN_DOCUMENTS:
        return PIECE_BYTES
    return max(MIN_PIECE_BYTES, sum(sizes) // MIN_DOCUMENTS)


def text_pieces(stream: pa.NativeFile, piece_bytes: int = PIECE_BYTES) -> Iterator[bytes | None]:
    """The documents of the file open as ``stream``: all of it, or where it is larger than ``piece_bytes``, pieces of
    at most that size, each cut after its last line end (mid-line only where a piece holds none). A file that is
    not text (a NUL byte among its first ``BINARY_SNIFF_BYTES``, or its first piece's where pieces are smaller: no
    text encoding but UTF-16's writes one) is one None, read no further."""
    rest, pieces = b"", 0
    while chunk := stream.read(piece_bytes - len(rest)):
        if not pieces and len(rest) < BINARY_SNIFF_BYTES and b"\0" in chunk[: BINARY_SNIFF_BYTES - len(rest)]:
            yield None
            return
        rest += chunk
        if len(rest) == piece_bytes:
            cut = rest.rfind(b"\n") + 1 or piece_bytes
            yield rest[:cut]
            rest, pieces = rest[cut:], pieces + 1
    if rest or not pieces:  # an empty file is a document of no text, as any empty file is
        yield rest


class TextFiles(FileBasedDatasource):
    """A dataset of one column, ``text`` (bytes; null for a file that is not text): the documents of the files
    (``text_pieces``)."""

    def __init__(self, paths: list[str], filesystem: pafs.FileSystem, piece_bytes: int = PIECE_BYTES):
        super().__init__(paths, filesystem=filesystem)
        self.piece_bytes = piece_bytes

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        for piece in text_pieces(f, self.piece_bytes):
            yield pa.table({"text": pa.array([piece], pa.binary())})

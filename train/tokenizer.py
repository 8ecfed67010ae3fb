"""Tokenizers in GPT-2's byte-level scheme: every token stands for a run of bytes.

- ``ByteTokenizer``: the zero-setup default. Token i < 256 is byte i, token 256
  (``<|endoftext|>``) ends a document. It needs no vocabulary file and handles any bytes.
- ``BPETokenizer``: a Hugging Face ``tokenizers`` byte-level BPE, trained on the corpus by
  ``prepare`` (``data.tokenizer: bpe``) or loaded from a ``tokenizer.json`` / HF model dir.

Both are Hugging Face tokenizers underneath (the byte tokenizer is a BPE with no merges whose
ids follow the bytes), so an export carries a ``tokenizer.json`` that ``transformers`` loads,
and decoding yields bytes, which serving turns into text with an incremental UTF-8 decoder.
"""

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from train import storage
from train.schema import Section

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MAX_VOCAB = 2**16  # prepared datasets store token ids as uint16


class TokenizerSpec(Section):
    """What a manifest, checkpoint or export records about a tokenizer beside its file."""

    type: str  # "byte" or "bpe"
    vocab_size: int
    eot_id: int
    sha256: str  # of its tokenizer.json text


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:  # control and space bytes get characters past 255, in byte order
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _as_text(text: str | bytes) -> str:
    """Text as the BPE encodes it: bytes decoded as UTF-8, invalid sequences replaced."""
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


class BPETokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` with an ``<|endoftext|>`` token."""

    kind = "bpe"

    def __init__(self, tokenizer: Tokenizer, source: str = "tokenizer"):
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise ValueError(f"{source}: only byte-level BPE tokenizers (GPT-2's scheme) are supported")
        self.eot_id = tokenizer.token_to_id(EOT)
        if self.eot_id is None:
            raise ValueError(f"{source}: the tokenizer has no {EOT} token")
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(f"{source}: vocabulary of {self.vocab_size} tokens; at most {MAX_VOCAB} are supported")
        self.hf = tokenizer
        to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
        self.token_bytes = [b""] * self.vocab_size  # special tokens carry no text
        for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
            if token not in special:
                self.token_bytes[token_id] = bytes(to_byte[char] for char in token)

    def encode(self, text: str | bytes) -> np.ndarray:
        """The tokens of one text (a prompt): no batch call, which would start the tokenizer's thread pool."""
        return np.array(self.hf.encode(_as_text(text), add_special_tokens=False).ids, dtype=np.uint16)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """The tokens of each text, from one call that tracks no character offsets: on Python source a third
        faster per text than ``encode``."""
        encodings = self.hf.encode_batch_fast([_as_text(text) for text in texts], add_special_tokens=False)
        return [np.array(e.ids, dtype=np.uint16) for e in encodings]

    def decode(self, tokens: Iterable[int]) -> bytes:
        """The bytes of ``tokens``, special tokens dropped (callers decode UTF-8 incrementally)."""
        return b"".join(self.token_bytes[int(t)] for t in tokens)

    def to_json(self) -> str:
        """The Hugging Face ``tokenizer.json`` text."""
        return self.hf.to_str()

    def spec(self) -> TokenizerSpec:
        digest = hashlib.sha256(self.to_json().encode()).hexdigest()
        return TokenizerSpec(type=self.kind, vocab_size=self.vocab_size, eot_id=self.eot_id, sha256=digest)


class ByteTokenizer(BPETokenizer):
    """One token per byte (ids 0-255) and ``<|endoftext|>`` as 256."""

    kind = "byte"

    def __init__(self):
        alphabet = bytes_to_unicode()
        vocab = {alphabet[byte]: byte for byte in range(256)} | {EOT: 256}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([EOT])
        super().__init__(tokenizer, "byte tokenizer")

    def encode(self, text: str | bytes) -> np.ndarray:
        """Exact for any bytes, valid UTF-8 or not (the BPE path would replace invalid bytes)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (all 256 bytes and ``<|endoftext|>`` included) trained on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return BPETokenizer(tokenizer, "trained BPE")


def save_tokenizer(tokenizer: BPETokenizer, directory: str) -> None:
    """Write ``<directory>/tokenizer.json`` (local or URI)."""
    storage.write_bytes(storage.join(directory, TOKENIZER_FILE), tokenizer.to_json().encode())


def load_tokenizer(location: str) -> BPETokenizer:
    """The tokenizer in a ``tokenizer.json`` file or in a directory holding one (local or URI).

    The byte tokenizer's file gives back a ``ByteTokenizer``, whose encoding is exact for any bytes.
    """
    uri = location if location.endswith(".json") else storage.join(location, TOKENIZER_FILE)
    data = storage.read_if_exists(uri)
    if data is None:
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {location}")
    text = data.decode()
    byte_tokenizer = ByteTokenizer()
    if text == byte_tokenizer.to_json():
        return byte_tokenizer
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{uri}: not a Hugging Face tokenizer.json ({exc})") from None
    return BPETokenizer(tokenizer, uri)

"""Byte-level tokenizer: token i < 256 is byte i, token 256 ends a document.

It needs no vocabulary file, handles any text, and is stored by name with every
dataset and checkpoint so that serving decodes exactly what training encoded.
"""

import numpy as np


class ByteTokenizer:
    name = "byte"
    eot_id = 256
    vocab_size = 257

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens: list[int] | np.ndarray) -> bytes:
        """The bytes of ``tokens``, end-of-text tokens dropped (callers decode UTF-8 incrementally)."""
        return bytes(int(t) for t in tokens if int(t) < 256)

    def to_dict(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}


def tokenizer_from_dict(spec: dict) -> ByteTokenizer:
    if spec.get("type") != ByteTokenizer.name:
        raise ValueError(f"unknown tokenizer {spec.get('type')!r}; known: ['byte']")
    return ByteTokenizer()

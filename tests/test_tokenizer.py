"""Tokenizers: the byte tokenizer as an HF tokenizer, trained BPEs, files, and what is refused."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from train.tokenizer import EOT, BPETokenizer, ByteTokenizer, load_tokenizer, save_tokenizer, train_bpe

pytestmark = pytest.mark.unit

TEXTS = ["plain ASCII text", "Grüße, naïve café", "中文 日本語 한국어", "tabs\tand   runs  of\n\n spaces ", "🚀☕€"]


def test_byte_tokenizer_is_the_identity_on_bytes_and_its_hf_form_agrees():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (257, 256)
    for text in TEXTS:
        ids = tokenizer.encode(text).tolist()
        assert ids == list(text.encode()) == tokenizer.hf.encode(text).ids
        assert tokenizer.decode(ids) == text.encode()
    assert tokenizer.decode([72, 256, 105]) == b"Hi"  # end-of-text carries no text
    assert tokenizer.encode(b"\xff\xfe").tolist() == [255, 254]  # any bytes, UTF-8 or not
    assert [ids.tolist() for ids in tokenizer.encode_batch([b"\xff", "é"])] == [[255], [195, 169]]


def test_trained_bpe_compresses_and_decodes_to_the_exact_bytes(tmp_path):
    tokenizer = train_bpe(["def main(argv):\n    return parse(argv)\n", *TEXTS] * 50, vocab_size=400)
    assert 257 < tokenizer.vocab_size <= 400
    assert tokenizer.decode([tokenizer.eot_id]) == b""
    source = "def main(argv):\n    return parse(argv)\n"
    assert len(tokenizer.encode(source)) < len(source.encode()) / 2
    for text in [source, *TEXTS]:
        assert tokenizer.decode(tokenizer.encode(text)) == text.encode()
    # A batch (as prepare tokenizes) gives each text the tokens of the tokenizer's own encode, invalid UTF-8 replaced.
    batch = [source, *TEXTS, b"caf\xe9 \xff"]
    expected = [tokenizer.hf.encode(text if isinstance(text, str) else "caf\ufffd \ufffd").ids for text in batch]
    assert [ids.tolist() for ids in tokenizer.encode_batch(batch)] == expected
    # A multi-byte character may end in the middle of a token run; the bytes still join up.
    pieces = b"".join(tokenizer.decode([t]) for t in tokenizer.encode("中文 Grüße"))
    assert pieces.decode() == "中文 Grüße"

    save_tokenizer(tokenizer, str(tmp_path))
    assert load_tokenizer(str(tmp_path)).spec() == tokenizer.spec()
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).spec() == tokenizer.spec()
    save_tokenizer(ByteTokenizer(), str(tmp_path))
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)


def test_tokenizers_raywright_cannot_decode_to_bytes_are_refused_with_the_reason(tmp_path):
    no_eot = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    no_eot.decoder = ByteTokenizer().hf.decoder
    with pytest.raises(ValueError, match=f"no {EOT} token"):
        BPETokenizer(no_eot, "mine")
    word_level = Tokenizer(models.WordLevel(vocab={EOT: 0, "a": 1}, unk_token=EOT))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="mine: only byte-level BPE"):
        BPETokenizer(word_level, "mine")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json at"):
        load_tokenizer(str(tmp_path / "missing"))

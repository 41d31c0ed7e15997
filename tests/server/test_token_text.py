"""Logprob token bytes (server/token_text.py) for both vocabulary spellings, without a server."""

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models
from transformers import PreTrainedTokenizerFast

from tokenmill.model.loader import default_model_path
from tokenmill.server.token_text import TokenText
from tokenmill.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A Llama-2-style vocabulary: '▁' for spaces and <0xNN> byte-fallback tokens."""
    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xE2>": 2, "▁the": 3, "▁": 4, "cat": 5, "<0x3C>": 6}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))


def test_sentencepiece_byte_tokens_are_their_byte(sentencepiece_style):
    tt = TokenText(sentencepiece_style)
    assert tt.bytes(1) == [0x0A]  # not the bytes of the text '<0x0A>'
    assert tt.bytes(2) == [0xE2] and tt.bytes(6) == [0x3C]
    assert tt.bytes(3) == list(b" the") and tt.bytes(5) == list(b"cat")


def test_byte_level_tokens_are_their_bytes():
    tok = Tokenizer.load(default_model_path())
    tt = TokenText(tok)
    newline = tok.encode("\n", add_special_tokens=False)
    assert [b for t in newline for b in tt.bytes(t)] == [0x0A]
    word = tok.encode(" Paris", add_special_tokens=False)
    assert [b for t in word for b in tt.bytes(t)] == list(b" Paris")
    emoji = tok.encode("🙂", add_special_tokens=False)  # split across tokens: each holds part of the UTF-8
    assert [b for t in emoji for b in tt.bytes(t)] == list("🙂".encode())

"""Token id -> its text and its bytes, for logprobs in responses."""

from __future__ import annotations

import json
import re

from tokenmill.tokenizer import Tokenizer, byte_to_unicode


class TokenText:
    """Token id -> its text and its bytes, cached (for logprobs). A token's bytes depend on how its vocabulary
    spells them: byte-level BPE (GPT-2's printable alias per byte), SentencePiece with byte fallback ('<0x0A>' is
    the byte 0x0A, '▁' a space), or else the UTF-8 of its decoded text."""

    _SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._unbyte = {c: b for b, c in byte_to_unicode().items()}
        decoder = json.loads(tok.hf_tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self._text[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s

    def bytes(self, tid: int) -> list[int]:
        b = self._bytes.get(tid)
        if b is None:
            piece = self.tok.convert_ids_to_tokens([tid])[0] or ""
            byte = self._SP_BYTE.fullmatch(piece) if self.byte_fallback else None
            if byte:
                b = [int(byte.group(1), 16)]
            elif self.byte_fallback:
                b = list(piece.replace("\u2581", " ").encode("utf-8"))
            elif self.byte_level and piece and all(c in self._unbyte for c in piece):
                b = [self._unbyte[c] for c in piece]
            else:
                b = list(self.text(tid).encode("utf-8"))
            self._bytes[tid] = b
        return b

"""Prompt lookup (n-gram) proposals: the output often repeats the prompt (edit this code, quote this text), so the
tokens that followed the last occurrence of the sequence's final n tokens are a good guess for what comes next.
Plain Python, no model: a search over the request's own tokens with bytes.rfind (C speed)."""

from __future__ import annotations

from array import array

_WIDTH = array("i").itemsize


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, for the longest n in
    [min_n, max_n] that occurs; [] when none does."""
    if k < 1 or len(tokens) <= min_n:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = data[-n * _WIDTH:]
        end = len(data) - _WIDTH  # an occurrence must end before the sequence's last token
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % _WIDTH == 0:  # aligned on a token, not across two
                start = at // _WIDTH + n
                return tokens[start:start + k]
            end = at + len(suffix) - 1
    return []

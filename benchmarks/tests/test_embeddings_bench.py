"""benchmarks/embeddings.py's parts that need no server: the texts are held-out ShareGPT turns cut to the token
budget, both peers pool the last token and normalize, and the cosine of the two servers' vectors is the usual one."""

from __future__ import annotations

import pytest

from benchmarks.tests.scripts import load_benchmark_script


def test_texts_peers_and_cosine():
    bench = load_benchmark_script("embeddings.py")
    from tokenmill.tokenizer import Tokenizer

    items = bench.texts(12, 32)
    tok = Tokenizer.load(bench.gguf_path())
    assert len(items) == 12 and all(8 <= len(tok.encode(t, add_special_tokens=False)) <= 34 for t in items)
    ours, theirs = bench.peers(2, 8, 64, "/bin/llama-server")
    assert ours.command[ours.command.index("--pooling") + 1] == "last" and "--runner" in ours.command
    assert theirs.command[theirs.command.index("--pooling") + 1] == "last" and "--embedding" in theirs.command
    assert bench.cosine([1.0, 0.0], [1.0, 1.0]) == pytest.approx(2 ** -0.5)

"""benchmarks/kquant.py's memory part on a tiny GGUF (Q8_0, untied): the kept weights hold the file's blocks,
fewer bytes than the dequantized ones, and every matmul is counted under its format."""

from __future__ import annotations

from benchmarks.tests.scripts import load_benchmark_script
from gguf import GGMLQuantizationType as T

from tests.model.test_loader import _tiny_gguf


def test_memory_part_counts_kept_and_dequantized_weights(tmp_path, monkeypatch):
    kquant = load_benchmark_script("kquant.py")
    path, _, _ = _tiny_gguf(tmp_path, "llama", qtype=T.Q8_0, tie_word_embeddings=False)
    import tokenmill

    real = tokenmill.LLM
    monkeypatch.setattr(tokenmill, "LLM", lambda model, **kw: real(model, tokenizer=str(tmp_path / "tiny-llama-0"),
                                                                     **kw))
    got = kquant.weight_memory(str(path))
    kept, dense = got["kept"], got["dequantized"]
    assert kept["matmuls_by_type"] == {str(int(T.Q8_0)): 2 * 4 + 1} and dense["matmuls_by_type"] == {"dense": 9}
    assert kept["weights_mib"] < dense["weights_mib"]
    # the blocks as the file has them (its float32 norms held in bfloat16), beside the rotary tables, which a tiny
    # model's weights do not outweigh; all of it is what the start-up line counts
    assert 0.95 <= kept["x_file_less_rotary"] < 1.05 and kept["x_file"] > kept["x_file_less_rotary"]

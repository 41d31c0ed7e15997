"""benchmarks/pure_q4_gguf.py on the embedded SmolLM2 file: the Q8_0 token embedding becomes Q4_1 blocks (ggml's
reference rounding of its values), every other tensor and every metadata field is copied unchanged, and tokenmill's
GGUF reader takes the result."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from benchmarks.tests.scripts import load_benchmark_script
from tokenmill.formats.gguf import GGUFFile
from tokenmill.model.paths import default_model_path

pure_q4_gguf = load_benchmark_script("pure_q4_gguf.py")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("pure") / "pure.gguf"
    assert pure_q4_gguf.main(["--type", "Q4_1", "--out", str(out)]) == 0
    return out


def test_the_head_is_requantized_and_everything_else_copied(written):
    before, after = GGUFFile.open(default_model_path()), GGUFFile.open(written)
    assert after.metadata == before.metadata  # every field, as tokenmill reads it
    assert list(after.tensors) == list(before.tensors)
    for name, info in after.tensors.items():
        old = before.tensors[name]
        assert info.shape == old.shape
        if name == "token_embd.weight":
            assert old.ggml_type == GGMLQuantizationType.Q8_0 and info.ggml_type == GGMLQuantizationType.Q4_1
            rows = slice(None, None, 12)  # 4,096 of the 49,152 rows: ggml's rounding, block by block
            q8 = before.read_raw(name).numpy().reshape(old.shape[0], -1)[rows]
            expected = quantize(dequantize(q8, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q4_1)
            assert np.array_equal(after.read_raw(name).numpy().reshape(info.shape[0], -1)[rows], expected)
        else:
            assert info.ggml_type == old.ggml_type and torch.equal(after.read_raw(name), before.read_raw(name))
    assert written.stat().st_size < 0.9 * default_model_path().stat().st_size  # 30 MB of Q8_0 -> 17 MB of Q4_1


def test_tokenmill_reads_the_written_file(written):
    f = GGUFFile.open(written)
    info = f.tensors["token_embd.weight"]
    assert info.ggml_type == GGMLQuantizationType.Q4_1 and info.shape == (49152, 576)
    ours = f.read_tensor("token_embd.weight")  # our Q4_1 decoder against gguf-py's on the same blocks
    blocks = f.read_raw("token_embd.weight").numpy().reshape(info.shape[0], -1)
    theirs = dequantize(blocks, GGMLQuantizationType.Q4_1)
    assert torch.equal(ours, torch.from_numpy(theirs))

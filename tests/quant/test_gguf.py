"""Our GGUF reader and dequantizers against the gguf package (llama.cpp's own Python reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

import tokenmill.formats.gguf_blocks as tm_gguf_blocks
from tokenmill.errors import ModelLoadError
from tokenmill.formats.gguf import GGUFFile
from tokenmill.formats.gguf_blocks import dequantize
from tokenmill.model.loader import default_model_path

OWN_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1]


def _random_rows(seed: int, shape: tuple[int, int] = (8, 256)) -> np.ndarray:
    """Rows of different magnitudes and signs, some constant blocks (d = 0 in the quantizers)."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10, (shape[0], 1)).astype(np.float32)
    data[0, :32] = 0.0
    data[1, 32:64] = 3.25
    data[2] = np.abs(data[2])
    return data


def _ref(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)


@pytest.mark.parametrize("qtype", OWN_TYPES, ids=lambda t: t.name)
def test_own_dequantizers_match_gguf_package_exactly(qtype: T) -> None:
    data = _random_rows(int(qtype))
    raw = quants.quantize(data, qtype)
    ours = dequantize(raw, qtype, data.shape)
    assert ours.dtype == torch.float32 and ours.shape == data.shape
    assert torch.equal(ours, _ref(raw, qtype, data.shape))
    # raw bytes as a torch uint8 tensor decode the same
    as_bytes = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).copy())
    assert torch.equal(dequantize(as_bytes, int(qtype), data.shape), ours)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_quantized_types_are_close_to_the_source(qtype: T) -> None:
    """A sanity bound independent of the reference: error within one quantization step per block."""
    data = _random_rows(7)
    ours = dequantize(quants.quantize(data, qtype), qtype, data.shape).numpy()
    blocks, rec = data.reshape(-1, 32), ours.reshape(-1, 32)
    span = blocks.max(1) - blocks.min(1) if qtype == T.Q4_1 else 2 * np.abs(blocks).max(1)
    step = span / {T.Q8_0: 254, T.Q4_0: 15, T.Q4_1: 15}[qtype]
    assert np.all(np.abs(blocks - rec).max(1) <= step * 1.01 + 1e-6)


def test_block_layouts_by_hand() -> None:
    """The documented layouts, built byte by byte (independent of gguf's quantizer)."""
    d, m = np.float16(0.5), np.float16(-1.0)
    low, high = np.arange(16, dtype=np.uint8), np.arange(15, -1, -1, dtype=np.uint8)
    nibbles = (low | (high << 4)).astype(np.uint8)
    q4 = np.concatenate([low, high]).astype(np.float32)  # element i: low nibble (i<16), high nibble (i>=16)

    q4_0 = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), nibbles])
    assert torch.equal(dequantize(q4_0, T.Q4_0, (32,)), torch.from_numpy((q4 - 8) * 0.5))

    q4_1 = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), np.frombuffer(m.tobytes(), np.uint8), nibbles])
    assert torch.equal(dequantize(q4_1, T.Q4_1, (32,)), torch.from_numpy(q4 * 0.5 - 1.0))

    q8 = np.arange(-16, 16, dtype=np.int8)
    q8_0 = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), q8.view(np.uint8)])
    assert torch.equal(dequantize(q8_0, T.Q8_0, (32,)), torch.from_numpy(q8.astype(np.float32) * 0.5))


def test_bf16_is_the_top_half_of_float32() -> None:
    x = np.array([1.0, -2.5, 3.140625, 2.0**100, -0.0], dtype=np.float32)  # all exact in bf16
    raw = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert torch.equal(dequantize(raw.view(np.uint8), T.BF16, (5,)), torch.from_numpy(x))


def test_other_types_fall_back_to_gguf_package() -> None:
    data = _random_rows(3, (4, 64))
    raw = quants.quantize(data, T.Q5_0)
    assert torch.equal(dequantize(raw, T.Q5_0, data.shape), _ref(raw, T.Q5_0, data.shape))
    # a K-quant (the gguf package can decode but not encode it): random blocks with a sane scale
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (6, 210), dtype=np.uint8)
    blocks[:, -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw = blocks.reshape(2, 3 * 210)
    assert torch.equal(dequantize(raw, T.Q6_K, (2, 768)), _ref(raw, T.Q6_K, (2, 768)))


@pytest.mark.parametrize("qtype", [*OWN_TYPES, T.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dequantize_into_a_narrower_dtype_goes_by_chunks(qtype: T, dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly the float32 decode, cast; 7 rows in chunks of 3 (the last one short), so several chunks run."""
    data = _random_rows(11, (7, 256))
    raw = quants.quantize(data, qtype)
    monkeypatch.setattr(tm_gguf_blocks, "DEQUANTIZE_CHUNK", 3 * 256)
    out = dequantize(raw, qtype, data.shape, dtype)
    assert out.dtype == dtype and out.shape == data.shape
    assert torch.equal(out, dequantize(raw, qtype, data.shape).to(dtype))


def test_unknown_and_unsupported_types_raise() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown GGML tensor type 99.*Q4_1"):
        dequantize(np.zeros(64, np.uint8), 99, (64,))
    with pytest.raises(ModelLoadError, match=r"I8 is not supported.*Q8_0"):
        dequantize(np.zeros(64, np.uint8), T.I8, (64,))
    with pytest.raises(ModelLoadError, match="needs 34 bytes, got 33"):
        dequantize(np.zeros(33, np.uint8), T.Q8_0, (32,))


# ---------------------------------------------------------------------------------------------------------
# The real SmolLM2 file: our reader and decoders against GGUFReader + gguf.quants
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_reader() -> GGUFReader:
    return GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def smol_file() -> GGUFFile:
    return GGUFFile.open(default_model_path())


def test_reader_metadata_matches_gguf_package(smol_reader: GGUFReader, smol_file: GGUFFile) -> None:
    expected = {k: f.contents() for k, f in smol_reader.fields.items() if not k.startswith("GGUF.")}
    assert smol_file.metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert smol_file.metadata[key] == pytest.approx(value) if isinstance(value, float) else \
            smol_file.metadata[key] == value, key
    assert smol_file.version == smol_reader.fields["GGUF.version"].contents()


def test_a_header_cut_inside_the_vocabulary_is_a_clear_error(tmp_path, smol_file: GGUFFile) -> None:
    """The vocabulary's strings are read in their own loop: a file cut inside one, or inside the length before
    one, names the file and says truncated, as the rest of the header does."""
    data = default_model_path().read_bytes()
    first = "<|im_start|>".encode()  # token 1: its length prefix sits in the 8 bytes before it
    at = data.index(first)
    for n, cut in enumerate((at - 4, at + 3, at + 40_000)):
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=rf"cut{n}\.gguf.*truncated"):
            GGUFFile.open(path)


def test_opening_the_same_file_again_reuses_its_header_until_it_changes(tmp_path, smol_file: GGUFFile) -> None:
    again = GGUFFile.open(default_model_path())
    assert again.metadata is smol_file.metadata or again.metadata == smol_file.metadata
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(default_model_path().read_bytes())
    first = GGUFFile.open(copy)
    assert GGUFFile.open(copy).metadata is first.metadata  # unchanged: not parsed again
    copy.write_bytes(default_model_path().read_bytes()[:5000])  # rewritten: parsed again, and found cut
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile.open(copy)


def test_reader_tensor_table_matches_gguf_package(smol_reader: GGUFReader, smol_file: GGUFFile) -> None:
    assert list(smol_file.tensors) == [t.name for t in smol_reader.tensors]
    for t in smol_reader.tensors:
        info = smol_file.tensors[t.name]
        assert info.shape == tuple(int(n) for n in reversed(t.shape)), t.name
        assert info.ggml_type == t.tensor_type and info.offset == t.data_offset and info.nbytes == t.n_bytes


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight",
                                  "blk.29.attn_k.weight", "output_norm.weight"])
def test_real_tensors_match_gguf_package(smol_reader: GGUFReader, smol_file: GGUFFile, name: str) -> None:
    t = next(t for t in smol_reader.tensors if t.name == name)
    info = smol_file.tensors[name]
    raw = smol_file.read_raw(name)
    assert np.array_equal(raw.numpy(), np.ascontiguousarray(t.data).reshape(-1).view(np.uint8))
    assert torch.equal(smol_file.read_tensor(name), _ref(np.asarray(t.data), t.tensor_type, info.shape))


def test_real_tensor_read_in_bfloat16_is_the_float32_decode_cast(smol_file: GGUFFile) -> None:
    name = "token_embd.weight"  # Q8_0, the largest tensor: read in chunks of rows
    bf16 = smol_file.read_tensor(name, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, smol_file.read_tensor(name).to(torch.bfloat16))

"""GGUF files: a lean container reader (metadata and tensor locations; tensor bytes read on demand).

Why our own reader: `gguf.GGUFReader` builds a numpy view per metadata string and takes ~3-5 s on the
49k-token SmolLM2 vocabulary; parsing the header with `struct` takes a fraction of a second. The block formats the
tensors are stored in, and their dequantizers, are formats/gguf_blocks.py. torch is imported inside the functions that
use it: the API process reads GGUF headers (the tokenizer) without loading the model stack.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.errors import ModelLoadError
from tokenmill.formats.gguf_blocks import dequantize, tensor_nbytes

if TYPE_CHECKING:
    import torch


GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec): fixed-size scalars by struct format; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes live; `shape` is in torch order (GGUF stores ggml's reversed `ne`)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, from the start of the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads over a buffer, so a truncated header fails with a clear message."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"unexpected end of header at byte {self.pos}, wanted {n} more bytes (truncated?)")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str) -> Any:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {vtype}")

    def array(self) -> list[Any]:
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if count > self.size - self.pos:  # every element takes at least one byte
            raise ValueError(f"array of {count} elements runs past the end of the file (truncated?)")
        if etype in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
        if etype == _STRING:
            return self.strings(count)
        return [self.value(etype) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: the vocabulary and merges, ~100K strings a file, read in one tight loop (the
        general path took 0.37 s per open of SmolLM2's header)."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError(f"unexpected end of header at byte {pos}, wanted 8 more bytes (truncated?)")
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                raise ValueError(f"unexpected end of header at byte {pos + 8}, wanted {end - pos - 8} more bytes "
                                 "(truncated?)")
            append(buf[pos + 8:end].decode("utf-8"))
            pos = end
        self.pos = pos
        return out


@lru_cache(maxsize=1)
def _parsed_header(path: Path, size: int, mtime_ns: int) -> tuple[int, dict[str, Any], dict[str, GGUFTensorInfo]]:
    """The header of the file at `path` (resolved) as it is at `size` and `mtime_ns`: the last one is kept, since a
    start-up opens the same file three times (config, tokenizer, weights)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"file is {size} bytes, too small for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse_header(mm, size)
    except (ModelLoadError, OSError, ValueError, struct.error, UnicodeDecodeError, KeyError, OverflowError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


@dataclass
class GGUFFile:
    """A parsed GGUF header: metadata and tensor locations. Tensor bytes are read on demand."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @classmethod
    def open(cls, path: Path | str) -> GGUFFile:
        """Parse the header; any malformed or truncated file raises ModelLoadError naming it. The last header
        parsed is kept while the file's size and modification time stay the same (_parsed_header): treat
        `metadata` and `tensors` as read-only."""
        path = Path(path)
        try:
            stat = path.stat()
        except OSError as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
        version, metadata, tensors = _parsed_header(path.resolve(), stat.st_size, stat.st_mtime_ns)
        return cls(path=path, version=version, metadata=metadata, tensors=tensors)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def read_raw(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor's bytes as a writable uint8 tensor (a private copy: nothing pins the file); with `index`,
        only those of its index-th slice along the first dimension (one expert of a stacked [E, rows, cols])."""
        import torch
        info = self.tensors[name]
        nbytes, offset = info.nbytes, info.offset
        if index is not None:
            nbytes //= info.shape[0]
            offset += index * nbytes
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(offset)
            got = f.readinto(buf.numpy())
        if got != nbytes:
            raise ModelLoadError(f"GGUF file {self.path} is truncated inside tensor {name!r}")
        return buf

    def read_tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized to `dtype` (float32 if None), in torch shape order."""
        info = self.tensors[name]
        return dequantize(self.read_raw(name), info.ggml_type, info.shape, dtype)


def _parse_header(buf: Any, size: int) -> tuple[int, dict[str, Any], dict[str, GGUFTensorInfo]]:
    cur = _Cursor(buf, size)
    magic = bytes(buf[0:4])
    cur.take(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > size or n_kv > size:
        raise ValueError(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw_infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, rel_offset in raw_infos:
        info = GGUFTensorInfo(name, shape, ggml_type, data_start + rel_offset, tensor_nbytes(ggml_type, shape))
        if info.offset + info.nbytes > size:
            raise ValueError(f"truncated: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                             f"the file has {size} bytes")
        tensors[name] = info
    return version, metadata, tensors


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.scalar("<I")
    if n_dims > 8:
        raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
    ne = [cur.scalar("<Q") for _ in range(n_dims)]
    ggml_type, offset = cur.scalar("<I"), cur.scalar("<Q")
    return name, tuple(reversed(ne)), ggml_type, offset

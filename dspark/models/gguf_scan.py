"""A GGUF file's index read straight from its header bytes: the metadata fields (arrays by their
length only) and each tensor's type, shape, dtype and byte range.

`gguf.GGUFReader` builds a numpy view for every part of every field, the tokenizer's ~49k
tokens and ~48k merges included: 7-9 s for SmolLM2-135M on a 2-core CPU, where the engine needs
a dozen scalars. This walks the same layout with `struct` over a memory map and skips each
array's elements (a string array still reads each element's length to find the next one).
The GGUF layout (versions 2 and 3, little-endian):

  magic "GGUF" u32 | version u32 | tensor count u64 | field count u64
  field:   key (u64 length + UTF-8) | value type u32 | value
           (an array: element type u32 | count u64 | the elements)
  tensor:  name | n_dims u32 | dims u64 x n_dims (fastest first) | ggml type u32 | offset u64
  then padding to general.alignment (default 32): the tensor data, offsets counted from there

A tensor's shape and dtype are those of the raw array gguf's reader gives (dims reversed;
a quantized type's rows in bytes, uint8), so the dequantisation reads the same bytes:

  Q4_1 (blocks of 32 values in 20 bytes), dims (576, 960): shape (960, 360), dtype "|u1",
  n_bytes 960 * 576 * 20 / 32 = 345,600
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian u32
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

V = GGUFValueType
_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
            V.INT32: "<i", V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q",
            V.FLOAT64: "<d"}  # fmt: skip
Q = GGMLQuantizationType
# the numpy dtype of an unquantized tensor's raw array (the others: bytes, "|u1")
_ITEM_DTYPES = {Q.F16: "<f2", Q.F32: "<f4", Q.F64: "<f8", Q.I8: "|i1", Q.I16: "<i2",
                Q.I32: "<i4", Q.I64: "<i8"}  # fmt: skip


def scan_gguf(path: Path) -> tuple[dict, list[tuple]]:
    """(fields, tensors) of the file: fields maps each scalar or string key to its value and
    each array key + "#length" to its element count; a tensor is (name, ggml type, shape,
    dtype, offset from the file's start, n_bytes). Raises ValueError, naming the reason, for
    what it cannot read (a file cut short among them)."""
    try:
        return _scan(path)
    except struct.error as e:  # (unpack_from past the file's end)
        raise ValueError(f"the file ends inside its header: {e}") from e


def _scan(path: Path) -> tuple[dict, list[tuple]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, num_tensors, num_fields = struct.unpack_from("<IIQQ", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"bad magic {magic:#010x}, a GGUF file starts with {GGUF_MAGIC:#010x}")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version}; this reader takes {SUPPORTED_VERSIONS}")
        at = 24
        # (the three header values under the names gguf's reader gives them)
        fields: dict = {"GGUF.version": version, "GGUF.tensor_count": num_tensors,
                        "GGUF.kv_count": num_fields}  # fmt: skip
        for _ in range(num_fields):
            key, at = _string(buf, at)
            (kind,) = struct.unpack_from("<I", buf, at)
            at += 4
            if kind == V.ARRAY:
                element, count = struct.unpack_from("<IQ", buf, at)
                fields[f"{key}#length"] = count
                at = _skip_elements(buf, at + 12, element, count)
            else:
                fields[key], at = _value(buf, at, kind)
        infos = []
        for _ in range(num_tensors):
            name, at = _string(buf, at)
            (n_dims,) = struct.unpack_from("<I", buf, at)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
            at += 4 + 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", buf, at)
            at += 12
            infos.append((name, dims, kind, offset))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = at + (-at % alignment)
    return fields, [_tensor(*info, data_start) for info in infos]


def _tensor(name: str, dims: tuple[int, ...], kind: int, offset: int, data_start: int) -> tuple:
    ggml_type = GGMLQuantizationType(kind)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_bytes = math.prod(dims) * type_size // block_size
    shape = tuple(reversed(dims))
    dtype = _ITEM_DTYPES.get(ggml_type)
    if dtype is None:  # quantized: each row in bytes
        if shape[-1] % block_size:
            raise ValueError(f"tensor {name}: a row of {shape[-1]} values is not a whole "
                             f"number of {ggml_type.name} blocks of {block_size}")  # fmt: skip
        shape, dtype = (*shape[:-1], shape[-1] // block_size * type_size), "|u1"
    return name, int(kind), shape, dtype, data_start + offset, n_bytes


def _string(buf: mmap.mmap, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    end = at + 8 + n
    if end > len(buf):
        raise ValueError(f"a string of {n} bytes at byte {at} runs past the file's end")
    return buf[at + 8 : end].decode("utf-8"), end


def _value(buf: mmap.mmap, at: int, kind: int) -> tuple[object, int]:
    if kind == V.STRING:
        return _string(buf, at)
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {kind} at byte {at}")
    return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)


def _skip_elements(buf: mmap.mmap, at: int, kind: int, count: int) -> int:
    """The byte after `count` array elements of type `kind` from `at`."""
    if kind in _SCALARS:
        return at + count * struct.calcsize(_SCALARS[kind])
    if kind == V.STRING:
        for _ in range(count):
            at += 8 + struct.unpack_from("<Q", buf, at)[0]
        return at
    if kind == V.ARRAY:
        for _ in range(count):
            element, n = struct.unpack_from("<IQ", buf, at)
            at = _skip_elements(buf, at + 12, element, n)
        return at
    raise ValueError(f"unknown GGUF array element type {kind} at byte {at}")

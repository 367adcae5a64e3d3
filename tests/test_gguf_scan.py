"""models/gguf_scan.py reads a GGUF file's index from its header bytes: the same fields and
tensors as gguf's reader (the oracle) on tiny files of every tensor type the loader takes, and
on the default model; a file it cannot read is refused with the reason."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from dspark.models.gguf_scan import scan_gguf
from tests.gguf_writer import write_llama_gguf

Q = gguf.GGMLQuantizationType


def _reader_index(path):
    """The index as gguf.GGUFReader gives it (what the engine used to parse with)."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            fields[f"{key}#length"] = len(f.data)
        else:
            value = f.contents()
            fields[key] = value.item() if isinstance(value, np.generic) else value
    tensors = [(t.name, int(t.tensor_type), tuple(int(n) for n in t.data.shape), t.data.dtype.str,
                int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]  # fmt: skip
    return fields, tensors


def _fields(w):
    """Fields of every value type, arrays of strings, numbers, bools and arrays among them."""
    w.add_string("test.text", "héllo")
    w.add_bool("test.flag", True)
    w.add_uint8("test.u8", 7)
    w.add_int16("test.i16", -3)
    w.add_uint64("test.u64", 2**40)
    w.add_float64("test.f64", 0.1)
    w.add_array("test.tokens", ["a", "bé", "", "<s>"])
    w.add_array("test.scores", [0.5, -1.25])
    w.add_array("test.types", [1, 2, 3])
    w.add_array("test.bools", [True, False])
    w.add_array("test.nested", [[1, 2], [3]])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_the_scan_equals_the_reader(tiny_dir, qtype):
    d, config, weights = tiny_dir
    path = write_llama_gguf(d / f"scan_{qtype.name}.gguf", config, weights, qtype,
                            more_fields=_fields)  # fmt: skip
    fields, tensors = scan_gguf(path)
    want_fields, want_tensors = _reader_index(path)
    # an array of arrays: its elements (2) here; the reader's parts count its leaves (3)
    assert fields.pop("test.nested#length") == 2 and want_fields.pop("test.nested#length") == 3
    assert (fields, tensors) == (want_fields, want_tensors)
    assert fields["test.tokens#length"] == 4
    assert fields["test.text"] == "héllo" and fields["test.u64"] == 2**40
    assert int(qtype) in {t[1] for t in tensors}


@pytest.mark.slow
def test_the_scan_equals_the_reader_on_the_default_model(default_gguf):
    fields, tensors = scan_gguf(default_gguf)
    assert (fields, tensors) == _reader_index(default_gguf)
    assert fields["tokenizer.ggml.tokens#length"] == 49152 and len(tensors) == 272


def test_a_file_it_cannot_read_is_refused_with_the_reason(tmp_path, tiny_dir):
    d, config, weights = tiny_dir
    good = write_llama_gguf(d / "scan_good.gguf", config, weights, Q.Q8_0).read_bytes()
    cases = {
        "magic": (b"GGUX" + good[4:], "bad magic"),
        "version": (good[:4] + struct.pack("<I", 1) + good[8:], "GGUF version 1"),
        "cut": (good[:200], None),  # (struct.error or a string past the end)
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises((ValueError, struct.error), match=message):
            scan_gguf(path)

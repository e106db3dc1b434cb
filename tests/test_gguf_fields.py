"""models/gguf_fields.py: the reader whose long metadata arrays make their parts on demand gives the
same fields, parts (dtype, shape, bytes), data indices and contents as the gguf library's reader,
in both byte orders, and refuses a file cut inside its vocabulary."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedllm.models import gguf_fields
from pagedllm.models.gguf_fields import CompactGGUFReader, LazyParts

N = gguf_fields.LAZY_MIN_ELEMENTS + 44  # long enough to be read lazily


def _write(path: str, endian: gguf.GGUFEndian) -> None:
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_block_count(2)
    w.add_rope_freq_base(10000.0)
    w.add_name("fields")
    w.add_token_list([f"tok{i}" + "é" * (i % 3) for i in range(N)])  # multi-byte utf-8, uneven lengths
    w.add_token_types([i % 6 for i in range(N)])
    w.add_token_merges([f"t {i}" for i in range(N + 7)])
    w.add_array("fields.floats", [0.5 * i for i in range(N)])
    w.add_array("fields.short", ["a", "bc"])  # short: the library's own parts
    w.add_tensor("w", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_fields_equal_the_librarys(tmp_path, endian):
    path = str(tmp_path / "f.gguf")
    _write(path, endian)
    ref, got = gguf.GGUFReader(path), CompactGGUFReader(path)
    assert list(got.fields) == list(ref.fields)
    lazy = {k for k, f in got.fields.items() if isinstance(f.parts, LazyParts)}
    assert lazy == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "fields.floats"}
    for k, a in ref.fields.items():
        b = got.fields[k]
        assert (b.offset, b.name, list(b.types), list(b.data)) == (a.offset, a.name, list(a.types), list(a.data)), k
        assert len(b.parts) == len(a.parts), k
        for x, y in zip(a.parts, (b.parts[i] for i in range(len(b.parts)))):
            assert (y.dtype, y.shape, y.tobytes()) == (x.dtype, x.shape, x.tobytes()), k
        assert b.contents() == a.contents(), k
        assert b.contents(3 if len(a.data) > 3 else 0) == a.contents(3 if len(a.data) > 3 else 0), k
        assert [p.tobytes() for p in b.parts[-3:]] == [p.tobytes() for p in a.parts[-3:]], k  # slices, negatives
    assert got.fields["tokenizer.ggml.tokens"].contents(N - 1) == f"tok{N - 1}" + "é" * ((N - 1) % 3)
    assert [(t.name, t.data_offset) for t in got.tensors] == [(t.name, t.data_offset) for t in ref.tensors]
    assert np.array_equal(got.tensors[0].data, ref.tensors[0].data)


def test_cut_inside_the_vocabulary_is_an_error(tmp_path):
    path = str(tmp_path / "f.gguf")
    _write(path, gguf.GGUFEndian.LITTLE)
    data = open(path, "rb").read()
    at = data.index(b"tok100")  # inside the token list
    with open(path, "wb") as f:
        f.write(data[:at])
    with pytest.raises(ValueError, match="past the end of the file"):
        CompactGGUFReader(path)

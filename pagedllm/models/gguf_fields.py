"""A ``gguf.GGUFReader`` whose large array fields (a tokenizer's tokens, token types, merges) make
their parts on demand instead of at parse time.

The library's reader keeps every element of every array field as its own NumPy memmap views: a
string is two (length, bytes), each a ``np.memmap`` with its own ``__dict__``, about 1 KB each. A
151,936-token vocabulary (Qwen2.5's) thus took 293 MiB and 8-130 s to parse (quiet to loaded
2-core host), and the freed objects left the allocator's arenas fragmented: ~180 MiB of them stayed
resident for the engine's life. Here such a field keeps one int64 offset per element and its
``parts`` is a sequence that builds, when indexed, the same views the library would have kept
(``GGUFReader._get``: same dtype, byte order and bytes), so ``ReaderField.contents()`` and
transformers' GGUF readers (``field.parts[i] for i in field.data``) see the same values.

Fields of fewer than ``LAZY_MIN_ELEMENTS`` elements, arrays of arrays, and every scalar or string
field are parsed by the library as before. The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(an array is item type uint32, count uint64, then the items; a string is length uint64, then bytes).
"""
from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

# Arrays shorter than this keep the library's eager parts (the saving is in the long ones).
LAZY_MIN_ELEMENTS = 256


class LazyParts(Sequence):
    """``head`` (list of arrays) followed by ``count * per`` parts made by ``make(j)`` (the ``per``
    parts of element j, a tuple) when indexed; slices give lists."""

    def __init__(self, head: list, count: int, per: int, make: Callable[[int], tuple]) -> None:
        self.head, self.count, self.per, self.make = head, count, per, make

    def __len__(self) -> int:
        return len(self.head) + self.count * self.per

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"part {i} of {n}")
        if i < len(self.head):
            return self.head[i]
        j, k = divmod(i - len(self.head), self.per)
        return self.make(j)[k]


class CompactGGUFReader(GGUFReader):
    """``GGUFReader`` with ``LazyParts`` for long arrays of strings or scalars (see the module's doc).
    Raises what ``GGUFReader`` raises for a bad file."""

    def _build_fields(self, offs: int, count: int) -> int:
        # The library's loop (gguf-py 0.19 ``GGUFReader._build_fields``) with a lazy branch for long arrays.
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            lazy = self._lazy_array(offs, int(raw_kv_type[0]), head)
            if lazy is None:
                field_size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                parts, data = head + field_parts, [idx + len(head) for idx in field_idxs]
            else:
                field_size, parts, data, field_types = lazy
            self._push_field(ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts, data, field_types),
                             skip_sum=True)
            offs += field_size
        return offs

    def _lazy_array(self, offs: int, raw_type: int, head: list) -> Optional[tuple[int, LazyParts, range, list]]:
        """(bytes, parts, data indices, types) of an array field at ``offs`` read lazily, or None
        for a field the library parses (not an array, short, or an array of arrays)."""
        if raw_type != GGUFValueType.ARRAY:
            return None
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        start = offs + 12
        if n < LAZY_MIN_ELEMENTS:
            return None
        head = head + [raw_itype, alen]
        # The makers hold the memory map and the byte order, not the reader: no reference cycle,
        # so the reader is freed as soon as its last user lets go (models/gguf.py clears its cache).
        data, order = self.data.view(np.ndarray), self.byte_order
        if itype == GGUFValueType.STRING:
            starts, end = string_offsets(data, start, n, order)

            def make(j: int) -> tuple:
                at = int(starts[j])
                length = _view(data, at, np.uint64, 1, order)
                return length, _view(data, at + 8, np.uint8, int(length[0]), order)

            return end - offs, LazyParts(head, n, 2, make), range(len(head) + 1, len(head) + 2 * n, 2), \
                [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # an array of arrays: the library's parts
            return None
        itemsize = np.dtype(nptype).itemsize

        def make_scalar(j: int) -> tuple:
            return (_view(data, start + j * itemsize, nptype, 1, order),)

        return 12 + n * itemsize, LazyParts(head, n, 1, make_scalar), range(len(head), len(head) + n), \
            [GGUFValueType.ARRAY, itype]


def _view(data: np.ndarray, offset: int, dtype: Any, count: int, byte_order: str) -> np.ndarray:
    """``count`` items of ``dtype`` at byte ``offset`` of the map, as ``GGUFReader._get`` makes them
    (a view in the file's byte order: "I" as is, "S" swapped)."""
    end = offset + np.dtype(dtype).itemsize * count
    arr = data[offset:end].view(dtype=dtype)[:count]
    return arr.view(arr.dtype.newbyteorder(byte_order))


def string_offsets(data: np.ndarray, offs: int, n: int, byte_order: str) -> tuple[np.ndarray, int]:
    """(int64 [n]: the byte offset of each of ``n`` consecutive length-prefixed strings from
    ``offs``, the byte after the last). Raises ValueError where one runs past the file's end."""
    little = (sys.byteorder == "little") != (byte_order == "S")
    unpack, buf = struct.Struct(("<" if little else ">") + "Q").unpack_from, memoryview(data)
    starts = np.empty(n, dtype=np.int64)
    end = len(buf)
    for j in range(n):
        starts[j] = offs
        if offs + 8 > end:
            raise ValueError(f"string {j} of an array at byte {offs} runs past the end of the file")
        offs += 8 + unpack(buf, offs)[0]
    if offs > end:
        raise ValueError(f"the last string of an array ends at byte {offs}, past the end of the file ({end})")
    return starts, offs

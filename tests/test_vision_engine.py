"""The engine's image bookkeeping without a model: chunks that keep an image whole, image hashes in
the prefix-cache block hashes, the encoder cache's LRU plan, M-RoPE positions of a step, and the
processed images' wire form (msgspec) between the API server and an engine core."""
from __future__ import annotations

import msgspec
import numpy as np
import torch

from pagedllm.engine import core_protocol as P
from pagedllm.engine.input_batch import mrope_positions
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.multimodal.inputs import MultiModalFeature, MultiModalInputs, TensorData
from pagedllm.sampling_params import SamplingParams


def feature(ident: str, offset: int, length: int, is_embed=None) -> MultiModalFeature:
    return MultiModalFeature(ident, offset, length, {"pixel_values": TensorData.of(torch.ones(3, 2, 2))}, is_embed)


def request(features, n: int = 20, mrope=None, delta: int = 0) -> Request:
    mm = MultiModalInputs(list(range(n)), features, TensorData.of(mrope) if mrope is not None else None, delta)
    return Request("r", list(range(n)), SamplingParams(), None, mm_inputs=mm)


def test_chunks_never_end_inside_an_image():
    r = request([feature("a", 4, 6), feature("b", 12, 3)])
    assert r.mm_chunk_tokens(0, 20) == 20        # all of it
    assert r.mm_chunk_tokens(0, 7) == 4          # would end inside a: stop before it
    assert r.mm_chunk_tokens(0, 10) == 10        # ends right after a
    assert r.mm_chunk_tokens(4, 3) == 0          # starts at a, cannot finish it this step
    assert r.mm_chunk_tokens(6, 2) == 0          # starts inside a (a prefix-cache hit), cannot finish it
    assert r.mm_chunk_tokens(6, 4) == 4          # ... can
    assert r.mm_chunk_tokens(10, 3) == 2         # stops before b


def test_block_hashes_include_the_images():
    kv = KVCacheManager(16, 4, True)
    a, b, text = request([feature("a" * 64, 4, 6)]), request([feature("b" * 64, 4, 6)]), request([])
    for r in (a, b, text):
        kv._update_block_hashes(r)
    assert a.block_hashes[0] == b.block_hashes[0] == text.block_hashes[0]  # tokens 0-3: text before the image
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:]))  # the image's blocks on
    assert a.block_hashes[1] != text.block_hashes[1]


def test_encoder_cache_plan_is_an_lru_of_rows():
    m = EncoderCacheManager(capacity=10)
    f1, f2, f3 = feature("1", 0, 4), feature("2", 0, 4), feature("3", 0, 4)
    s = m.plan([f1, f2])
    assert [i for i, _ in s.encode] == ["1", "2"] and s.evict == []
    s = m.plan([f1])
    assert s.encode == [] and (m.queries, m.hits) == (3, 1)
    s = m.plan([f3])  # room for 2 of 4 rows: the least recently used ("2") goes
    assert [i for i, _ in s.encode] == ["3"] and s.evict == ["2"]
    big = feature("4", 0, 30)  # larger than the cache: still encoded, the others make room
    s = m.plan([big])
    assert [i for i, _ in s.encode] == ["4"] and sorted(s.evict) == ["1", "3"]


def test_mrope_positions_of_a_step():
    mp = torch.tensor([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 3, 4, 5]])
    img = request([], n=6, mrope=mp, delta=-2)
    text = Request("t", list(range(5)), SamplingParams(), None)
    img.num_computed_tokens, text.num_computed_tokens = 0, 3
    pos = np.array([3, 0, 1, 2, 3, 4, 5], np.int64)  # a text decode at 3, then img's prompt 0..5
    out = mrope_positions(pos, [text], [(img, 6)], 1)
    assert out.shape == (3, 7)
    assert out[:, 0].tolist() == [3, 3, 3] and out[:, 1:].tolist() == mp.tolist()
    out = mrope_positions(np.array([6, 7], np.int64), [img, text], [], 2)  # decodes after the prompt
    assert out[:, 0].tolist() == [4, 4, 4] and out[:, 1].tolist() == [7, 7, 7]
    assert mrope_positions(pos, [text], [], 1) is pos  # no M-RoPE request: positions as they are


def test_processed_images_cross_the_wire():
    px = torch.randn(3, 4, 4)
    mm = MultiModalInputs([1, 2, 3], [MultiModalFeature("h", 1, 2, {"pixel_values": TensorData.of(px),
                                                                    "grid": TensorData.of(torch.tensor([1, 2, 2])),
                                                                    "bf": TensorData.of(px.bfloat16())},
                                                        [True, False])])
    msg = P.AddRequest("r", [1, 2, 3], SamplingParams(), 0.0, 0, None, mm)
    enc, _ = P.front_codec()
    _, dec = P.core_codec()
    got = dec.decode(enc.encode(msg)).mm_inputs
    t = got.features[0].tensors()
    assert torch.equal(t["pixel_values"], px) and t["grid"].tolist() == [1, 2, 2]
    assert torch.equal(t["bf"], px.bfloat16()) and got.features[0].num_embeds == 1
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(mm), type=MultiModalInputs) == mm

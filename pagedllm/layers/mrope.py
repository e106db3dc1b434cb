"""Multimodal rotary position embedding (M-RoPE; Wang et al., 2024, "Qwen2-VL", section 2.1): each
token has three positions, temporal / height / width, and each rotary frequency of a head turns with
one of them: the first ``mrope_section[0]`` frequencies with t, the next ``mrope_section[1]`` with h,
the last ``mrope_section[2]`` with w (transformers' ``Qwen2VLRotaryEmbedding`` and
``get_rope_index``; vLLM's ``MRotaryEmbedding``).

Text tokens have t = h = w, which is plain RoPE: a text-only prompt needs nothing of this module.
An image's tokens (t, h, w) = (start, start + row, start + column) on its grid of merged patches, and
the text after it continues from start + max(rows, columns): the prompt's last position is below its
length, by ``delta`` (<= 0). Generated tokens then sit at plain position index + delta on all three.

The rotary table is the language model's plain ``RotaryEmbedding`` table; M-RoPE only chooses, per
frequency, which of the three positions indexes it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from pagedllm.layers.rotary_embedding import RotaryEmbedding


def mrope_channel_streams(mrope_section: Sequence[int], rotary_dim: int) -> torch.Tensor:
    """[R] int64: which stream (0 t, 1 h, 2 w) indexes each channel of the rotate-half table, whose two
    halves repeat the R/2 frequencies. Raises ValueError when the sections do not add up to R/2."""
    if sum(mrope_section) * 2 != rotary_dim:
        raise ValueError(f"mrope_section {list(mrope_section)} adds up to {sum(mrope_section)}, "
                         f"not rotary_dim / 2 = {rotary_dim // 2}")
    half = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)])
    return torch.cat((half, half))


def mrope_cos_sin(rotary: RotaryEmbedding, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """[N, 2, 1, R]: ``rotary.cos_sin`` for M-RoPE ``positions`` [3, N] (int64): channel c gathered at
    ``positions[streams[c]]`` (``streams``: ``mrope_channel_streams``, on the table's device).
    A [N] ``positions`` is plain RoPE (``rotary.cos_sin(positions)``)."""
    if positions.dim() == 1:
        return rotary.cos_sin(positions)
    n = positions.shape[1]
    table = rotary.cos_sin_cache.index_select(0, positions.reshape(-1)).view(3, n, 2, -1)  # [3, N, 2, R]
    index = streams.view(1, 1, 1, -1).expand(1, n, 2, -1)
    return table.gather(0, index).squeeze(0).unsqueeze(2)


def mrope_input_positions(input_ids: Sequence[int], image_token_id: int, image_grid_thw: Sequence[Sequence[int]],
                          spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """The prompt's M-RoPE positions: ([3, L] int64, delta) where delta = max position + 1 - L, so the
    token at index i >= L (generated) has position i + delta on all three streams.

    Each image is a run of t*h*w / merge^2 ``image_token_id`` tokens, in ``image_grid_thw``'s order
    (in patches, before merging); its tokens sit at (start + frame, start + row, start + column) of its
    merged grid, row-major, and the next token at start + max(frames, rows, columns) (transformers'
    ``get_rope_index`` for images).

    Raises:
        ValueError: the image tokens do not add up to the grids' sizes.
    """
    ids = torch.as_tensor(list(input_ids), dtype=torch.int64)
    is_image = (ids == image_token_id).tolist()
    pieces, pos, i, n, grids = [], 0, 0, len(is_image), list(image_grid_thw)
    g = 0
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        if g >= len(grids):
            raise ValueError(f"the prompt has more image tokens than its {len(grids)} image(s) fill")
        t, h, w = (int(v) for v in grids[g])
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        size = t * gh * gw
        if i + size > n or not all(is_image[i:i + size]):
            raise ValueError(f"image {g} needs {size} consecutive image tokens at index {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack((tt.reshape(-1), hh.reshape(-1), ww.reshape(-1))) + pos)
        pos += max(t, gh, gw)
        i += size
        g += 1
    if g != len(grids):
        raise ValueError(f"the prompt holds the tokens of {g} image(s), not {len(grids)}")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
    return positions, pos - n


def mrope_positions_at(prompt_positions: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """[3, end - start] int64: the M-RoPE positions of token indexes [start, end) of a request whose
    prompt has ``prompt_positions`` [3, L] and ``delta``: the prompt's own where i < L, i + delta after."""
    length = prompt_positions.shape[1]
    parts = []
    if start < length:
        parts.append(prompt_positions[:, start:min(end, length)])
    if end > length:
        parts.append(torch.arange(max(start, length) + delta, end + delta).expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

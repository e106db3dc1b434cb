"""The batched LoRA op: one step's tokens of many adapters (and of the base model) at once.

For a target linear with base output y [N, out] and input x [N, in], every token t whose adapter sits
in slot s gets y[t] += B_s (A_s x[t]) (B_s stored transposed, Bt_s [R, out], the scale folded in at
load), never merged into the base weight. Tokens are grouped by slot once a step (``make_step``); then
per linear either

- ``grouped``: x gathered in group order, per adapter one shrink (x_g A_s^T) and one expand
  (h_g B_s^T) matmul over its tokens, one scatter-add back (S-LoRA's per-adapter GEMMs), or
- ``bmm``: the groups padded to the longest, the step's A and B gathered, two batched matmuls over
  all groups at once (Punica's BGMV as one bmm), one scatter-add.

Fused targets (qkv, gate_up) hold S slices: A_s stacks the slices' A (S r rows: one shrink matmul),
and each slice's B expands its part of the output (B is not stored block diagonal: decode steps
read every adapter's B once, and zeros would be read too). Row-parallel targets pass
``reduce``: the shrink of this rank's input shard is summed over the ranks before the expand.
Which of the two is faster is measured by ``pagedllm bench lora`` (benchmarks/README.md): grouped, at
decode and prefill shapes of SmolLM2 (bmm's gathers copy every adapter's A and B each call); auto
picks it, ``PAGEDLLM_LORA_OP=bmm`` the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

MODES = ("grouped", "bmm")


@dataclass
class LoRAStep:
    """One step's grouping of the flat batch's tokens by slot (shared by every target linear).

    slots: the step's slots in group order; order [T] int64: the LoRA tokens' rows in group order;
    bounds: (start, end) of each group in ``order``; pad_rows [G * L]: the row of x each padded group
    position reads (a group shorter than L repeats its first row); pad_valid [T]: the padded position
    of each token in ``order``."""
    slots: list[int]
    slots_t: torch.Tensor
    order: torch.Tensor
    bounds: list[tuple[int, int]]
    max_len: int
    pad_rows: Optional[torch.Tensor]
    pad_valid: Optional[torch.Tensor]
    mode: str


def make_step(token_slots: torch.Tensor, mode: str = "auto") -> Optional[LoRAStep]:
    """Group ``token_slots`` [N] (slot per token, -1 for the base model). None when no token has an
    adapter. ``mode``: grouped, bmm, or auto (grouped, the faster at every shape measured)."""
    sorted_slots, order = torch.sort(token_slots, stable=True)
    keep = sorted_slots >= 0
    order, sorted_slots = order[keep], sorted_slots[keep]
    if order.numel() == 0:
        return None
    uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    slots, counts_l = uniq.tolist(), counts.tolist()
    bounds, start = [], 0
    for c in counts_l:
        bounds.append((start, start + c))
        start += c
    max_len = max(counts_l)
    if mode == "auto":  # grouped: faster at every shape measured (benchmarks/README.md, pagedllm bench lora)
        mode = "grouped"
    pad_rows = pad_valid = None
    if mode == "bmm":
        rows, valid = [], []
        order_l = order.tolist()
        for g, (a, b) in enumerate(bounds):
            rows.extend(order_l[a:b])
            rows.extend([order_l[a]] * (max_len - (b - a)))
            valid.extend(range(g * max_len, g * max_len + b - a))
        pad_rows = torch.tensor(rows, dtype=torch.long, device=token_slots.device)
        pad_valid = torch.tensor(valid, dtype=torch.long, device=token_slots.device)
    return LoRAStep(slots, uniq, order, bounds, max_len, pad_rows, pad_valid, mode)


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
              slices: list[tuple[int, int]], step: LoRAStep,
              reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """y [N, out] += the LoRA term of each token (in place).

    x [N, in]; a [slots, S * R, in]: slice i's A of slot s in rows i R .. i R + ranks[s] (the rest zero);
    b [slots, R, out]: slice i's B transposed (scale folded in) in columns off_i .. off_i + size_i,
    rows :ranks[s]; ``slices``: (off_i, size_i); ranks[s] 0: slot s does not touch this target.
    ``reduce``: sums a shrink result over the tensor-parallel ranks (row-parallel targets), None: nothing."""
    n_slices = len(slices)
    big_r = a.shape[1] // n_slices
    if step.mode == "bmm":
        r = max(ranks[s] for s in step.slots)
        g, length = len(step.slots), step.max_len
        xp = x.index_select(0, step.pad_rows).view(g, length, x.shape[1])
        rows = a[step.slots_t, :r] if n_slices == 1 else a[step.slots_t]
        h = torch.bmm(xp, rows.transpose(1, 2))  # [G, L, S R] (one slice: [G, L, r])
        if reduce is not None:
            h = reduce(h)
        yp = torch.empty(g, length, y.shape[1], dtype=y.dtype, device=y.device)
        for i, (off, size) in enumerate(slices):
            yp[:, :, off:off + size] = torch.bmm(h[:, :, i * big_r:i * big_r + r],
                                                 b[step.slots_t, :r, off:off + size])
        y.index_add_(0, step.order, yp.view(g * length, -1).index_select(0, step.pad_valid))
        return
    xs = x.index_select(0, step.order)
    ys = y.new_zeros(xs.shape[0], y.shape[1])
    for s, (lo, hi) in zip(step.slots, step.bounds):
        r = ranks[s]
        if not r:
            continue
        if n_slices == 1:
            h = torch.mm(xs[lo:hi], a[s, :r].t())
            if reduce is not None:
                h = reduce(h)
            torch.mm(h, b[s, :r], out=ys[lo:hi])
            continue
        # one shrink for every slice (rows past a slice's rank are zero: read, but 0 when r = R)
        h = torch.mm(xs[lo:hi], (a[s] if r == big_r else a[s].view(n_slices, big_r, -1)[:, :r].reshape(-1, a.shape[2])).t())
        if reduce is not None:
            h = reduce(h)
        hr = big_r if r == big_r else r
        for i, (off, size) in enumerate(slices):
            ys[lo:hi, off:off + size].addmm_(h[:, i * hr:i * hr + r], b[s, :r, off:off + size])
    y.index_add_(0, step.order, ys)


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int],
                       slices: list[tuple[int, int]], token_slots: torch.Tensor) -> None:
    """The per-token definition ``lora_add_`` must equal (tests): y[t, slice i] += B_i (A_i x[t])."""
    for t, s in enumerate(token_slots.tolist()):
        r = ranks[s] if s >= 0 else 0
        for i, (off, size) in enumerate(slices):
            if r:
                big_r = a.shape[1] // len(slices)
                y[t, off:off + size] += b[s, :r, off:off + size].t() @ (a[s, i * big_r:i * big_r + r] @ x[t])

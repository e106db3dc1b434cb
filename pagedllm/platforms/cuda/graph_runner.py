"""CUDA graphs for decode steps: why a decode step on a GPU is not a few hundred Python kernel launches.

A decode step of a small model is bound by the host: every layer launches tens of small kernels from
Python. A CUDA graph records those launches once and replays them in one call. A graph replays fixed
shapes from fixed addresses, so (vLLM's scheme, ``vllm/v1/worker/gpu_model_runner.py``):

- decode-only steps are captured at a ladder of batch sizes (``capture_sizes``: 1, 2, 4, 8, then every
  8 up to ``max_num_seqs``, which is itself the top rung; at most 512);
- a step's inputs are copied into persistent buffers (``DecodeBuffers``: input_ids, positions,
  slot_mapping, block_tables, seq_lens, query_start_loc), padded to the next captured size; padding rows
  write their K/V into a scratch block no request owns (the block past the pool's last, which the
  model runner allocates for this) and attend only to that one slot (seq_len 1, block table row
  [scratch, 0, ...]), so they read and write nothing a real request reads;
- the graph ends at the model's last hidden states [b, hidden] (a fixed tensor per size; logits of
  every padded row would hold sizes x vocab floats per graph, 2.6 GiB over Qwen2's ladder); the step's
  ``logits_indices`` rows are gathered from it after the replay (a new tensor, so the next replay
  overwriting it does not change what the caller holds) and the model runner computes their logits
  eagerly, as an eager step does (one LM-head matmul: a few launches);
- steps with a prefill, or with more sequences than the largest rung, run eagerly (``eager_reason``).

The rules a graph-safe attention backend keeps (the model runner lets graphs run only with one, by
name: ``GRAPH_SAFE_BACKENDS``): no host syncs and no shape- or value-dependent Python in ``forward`` for a
decode-only batch; ``meta.max_decode_seq_len`` is read only as an upper bound (captured graphs see
``max_model_len``); anything kept in ``meta.derived`` is computed from the metadata's tensors with
device ops (the capture records those ops, so each replay recomputes it).

This module is the bookkeeping and imports nothing above ``platforms``: the model runner hands it a
``forward(b)`` that runs the model on the first b rows of the buffers. The capture itself goes through a
graph factory (``TorchCudaGraph`` on CUDA); tests pass a fake one whose replay runs ``forward`` eagerly
on the padded buffers (tests/test_cuda_graphs.py), so everything but the capture runs on the CPU.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("pagedllm")

# Attention backends whose decode path keeps the rules above (by ``AttentionBackend.name``).
GRAPH_SAFE_BACKENDS = ("triton", "flash-attn")
MAX_CAPTURE_SIZE = 512  # vLLM's default cap: a larger batch's launches are a small share of its step

# Why a step ran eagerly (the keys of ``CudaGraphRunner.eager_steps``).
PREFILL = "prefill in the step"
TOO_LARGE = "more sequences than the largest captured size"
TOO_WIDE = "block table wider than the buffer"


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes to capture, ascending: 1, 2, 4, 8, 16, ... (every 8) up to ``min(max_num_seqs, cap)``,
    which is the top rung even off the ladder (20 -> [1, 2, 4, 8, 16, 20]), so every decode batch the
    scheduler can form up to the cap has a graph.

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, cap)
    sizes = [s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(sizes: list[int], n: int) -> Optional[int]:
    """The smallest captured size >= n (``sizes`` ascending); None when n exceeds them all."""
    for s in sizes:
        if s >= n:
            return s
    return None


def graphs_off_reason(*, device: str, enforce_eager: bool, backend_name: str, world_size: int = 1,
                      pooling: bool = False) -> Optional[str]:
    """None when the model runner should capture decode graphs, else why not (for the start-up log)."""
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if backend_name not in GRAPH_SAFE_BACKENDS:
        return (f"attention backend {backend_name!r} is not graph-safe (it syncs with the host or loops over "
                f"sequences in Python); graph-safe: {', '.join(GRAPH_SAFE_BACKENDS)}")
    if world_size > 1:
        return f"tensor/pipeline parallelism (world size {world_size}): graphs cover one GPU"
    if pooling:
        return "the pooling runner has no decode steps"
    return None


class DecodeBuffers:
    """The persistent inputs of the captured decode steps, ``max_batch`` rows each (on ``device``).

    input_ids/positions/slot_mapping [max_batch] int64; block_tables [max_batch, max_blocks] int32;
    seq_lens [max_batch] int32; query_start_loc [max_batch + 1] int32 (row i starts at i: every row is
    one token, so it is written once). ``pad_block``: the scratch block the padding rows write and read.
    """

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, pad_block: int, device: Any) -> None:
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), self.pad_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.block_tables[:, 0] = pad_block
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def load(self, b: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Copy a decode step of n = len(input_ids) <= b rows into the first n rows and make rows n..b-1
        padding (token 0 at position 0, written to and reading only the scratch slot). ``block_tables``
        [n, w] with w <= max_blocks; its columns past w are zeroed (the backends read none of them)."""
        n, w = input_ids.shape[0], block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, w:].zero_()
        if b > n:  # padding rows
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(self.pad_slot)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
            self.block_tables[n:b, 0] = self.pad_block

    def pad_all(self, b: int) -> None:
        """Make the first b rows padding (the inputs a graph is captured with)."""
        self.input_ids[:b].zero_()
        self.positions[:b].zero_()
        self.slot_mapping[:b].fill_(self.pad_slot)
        self.seq_lens[:b].fill_(1)
        self.block_tables[:b].zero_()
        self.block_tables[:b, 0] = self.pad_block


class TorchCudaGraph:
    """One captured CUDA graph (``torch.cuda.CUDAGraph``) sharing the memory pool ``pool`` with the
    runner's other graphs (captured largest first, so the smaller ones fit in the larger's memory)."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` once eagerly on a side stream (lazy inits, Triton compiles and autotunes happen
        outside the capture), then record it; returns its output tensor, which every replay rewrites."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def torch_graph_factory() -> Callable[[], TorchCudaGraph]:
    """A factory of ``TorchCudaGraph`` that all share one new memory pool."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: TorchCudaGraph(pool)


class CudaGraphRunner:
    """Captures ``forward`` at each size of ``sizes`` and replays decode steps through the buffers.

    ``forward(b)`` runs the model on the first b rows of ``buffers`` and returns one row per buffer row
    ([b, hidden]: the last hidden states). ``new_graph()`` makes one graph object (``capture(fn)
    -> output``, ``replay()``). ``replays`` counts replays per captured size, ``eager_steps`` the steps
    that ran eagerly per reason (``PREFILL``, ``TOO_LARGE``, ``TOO_WIDE``).
    """

    def __init__(self, sizes: list[int], buffers: DecodeBuffers, forward: Callable[[int], torch.Tensor],
                 new_graph: Callable[[], Any]) -> None:
        if not sizes or sizes != sorted(sizes) or sizes[-1] > buffers.max_batch:
            raise ValueError(f"capture sizes must ascend and fit the buffers' {buffers.max_batch} rows; got {sizes}")
        self.sizes, self.buffers, self.forward, self.new_graph = sizes, buffers, forward, new_graph
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter = Counter()
        self.eager_steps: Counter = Counter()
        self.capture_seconds = 0.0

    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse the larger's pool memory)."""
        t0 = time.perf_counter()
        for b in reversed(self.sizes):
            self.buffers.pad_all(b)
            graph = self.new_graph()
            self.outputs[b] = graph.capture(lambda b=b: self.forward(b))
            self.graphs[b] = graph
        self.capture_seconds = time.perf_counter() - t0

    def eager_reason(self, num_tokens: int, num_decodes: int, block_table_width: int) -> Optional[str]:
        """None when a step of ``num_tokens`` tokens, the first ``num_decodes`` of them one-token
        sequences, replays a graph; else why it runs eagerly."""
        if num_decodes != num_tokens:
            return PREFILL
        if num_tokens > self.sizes[-1]:
            return TOO_LARGE
        if block_table_width > self.buffers.max_blocks:
            return TOO_WIDE
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: Optional[torch.Tensor], seq_lens: Optional[torch.Tensor], num_decodes: int,
            logits_indices: torch.Tensor) -> Optional[torch.Tensor]:
        """Rows ``logits_indices`` of the step's ``forward`` output ([M, hidden], a new tensor) by replaying
        the graph of the next captured size, or None when the step must run eagerly (counted in
        ``eager_steps``)."""
        n = input_ids.shape[0]
        reason = (PREFILL if block_tables is None or seq_lens is None
                  else self.eager_reason(n, num_decodes, block_tables.shape[1]))
        if reason is not None or n == 0:
            self.eager_steps[reason or "empty step"] += 1
            return None
        b = padded_size(self.sizes, n)
        self.buffers.load(b, input_ids, positions, slot_mapping, block_tables, seq_lens)
        self.graphs[b].replay()
        self.replays[b] += 1
        return self.outputs[b].index_select(0, logits_indices)

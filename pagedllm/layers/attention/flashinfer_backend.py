"""Paged attention through the ``flashinfer`` library (Ye et al., 2025), where it is installed:
``--attention-backend flashinfer``. Not a dependency of pagedllm; without it the backend refuses with
"flashinfer is not installed".

One ``BatchPrefillWithPagedKVCacheWrapper`` runs the whole flat batch (decodes are queries of length 1),
reading K/V in place from pagedllm's cache planes ([num_blocks, block_size, Hkv, D]: flashinfer's
"NHD" layout) through a page list built from the block tables. flashinfer plans each step on the host
(``plan``: the page list, once per step and per (window, soft-cap) kind of layer, kept in
``meta.derived``), so this backend is not graph-safe: with it decode steps run eagerly
(``platforms/cuda/graph_runner.py`` logs why).

Refused by name: a device other than CUDA, dtypes other than fp16/bf16, head_dim other than 64, 128
or 256, flashinfer without ``plan`` (< 0.2), and at run time the int8 KV cache, attention sinks, Llama 4's
chunked attention and MLA's one-plane cache (the torch and triton backends take those).
"""
from __future__ import annotations

import importlib.util
from typing import Any, Optional

import torch

from pagedllm.layers.attention.backend import AttentionBackend, write_kv
from pagedllm.layers.attention.flash_attn_backend import unsupported_features
from pagedllm.layers.attention.metadata import AttentionMetadata

LIBRARY = "flashinfer"
WORKSPACE_BYTES = 128 * 2 ** 20  # flashinfer's recommended scratch for split-k partials and plan data


def _library():
    """The ``flashinfer`` module (imported on first use)."""
    import flashinfer  # lazily: flashinfer is an optional library (and needs CUDA)

    return flashinfer


def page_list(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qo_indptr [B + 1], kv_indptr [B + 1], kv_indices [pages], last_page_len [B]), int32 on the host:
    flashinfer's description of the step's sequences (their queries' offsets; their pages, in order, as
    the first ceil(seq_len / block_size) entries of each block-table row; the tokens in each last page)."""
    bs = meta.block_size
    seq_lens = meta.seq_lens.cpu()
    tables = meta.block_tables.cpu()
    pages = (seq_lens + bs - 1) // bs
    kv_indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages, 0, dtype=torch.int32)
    used = torch.arange(tables.shape[1]).unsqueeze(0) < pages.unsqueeze(1)
    return (meta.query_start_loc.cpu(), kv_indptr, tables[used].to(torch.int32),
            (seq_lens - (pages - 1) * bs).to(torch.int32))


class FlashInferPagedAttention(AttentionBackend):
    name = "flashinfer"
    needs_zeroed_cache = False  # reads only the first seq_len slots of each sequence

    def __init__(self) -> None:
        self.wrappers: dict[Any, Any] = {}  # (device, window, soft-cap, scale) -> its planned wrapper

    @classmethod
    def unsupported_reason(cls, *, device: str, dtype: torch.dtype, head_dim: int,
                           block_size: int) -> Optional[str]:
        if importlib.util.find_spec(LIBRARY) is None:
            return "flashinfer is not installed (pip install flashinfer-python)"
        if torch.device(device).type != "cuda":
            return "flashinfer runs on CUDA only"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flashinfer takes float16 and bfloat16 here, not {str(dtype).replace('torch.', '')}"
        if head_dim not in (64, 128, 256):
            return f"flashinfer takes head_dim 64, 128 or 256 here, not {head_dim}"
        if not hasattr(_library().BatchPrefillWithPagedKVCacheWrapper, "plan"):
            return f"flashinfer {getattr(_library(), '__version__', '?')} has no plan() (needs >= 0.2)"
        return None

    def _wrapper(self, q: torch.Tensor, k: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: Optional[int], cap: Optional[float]) -> Any:
        """The wrapper of this kind of layer, planned for this step (by its first such layer)."""
        key = (q.device, window, cap, scale)
        if key not in self.wrappers:  # each its own workspace: two plans of one step must not share one
            fi = _library()
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self.wrappers[key] = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper = self.wrappers[key]
        if ("flashinfer", key) not in meta.derived:
            qo_indptr, kv_indptr, kv_indices, last_len = page_list(meta)
            # A query at position p sees p - W < j <= p: W - 1 keys to its left (flashinfer's window_left).
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_len, q.shape[1], k.shape[1], q.shape[2],
                         meta.block_size, causal=True, sm_scale=scale,
                         window_left=window - 1 if window else -1, logits_soft_cap=cap or 0.0,
                         q_data_type=q.dtype, kv_data_type=kv_cache.dtype)
            meta.derived[("flashinfer", key)] = True
        return wrapper

    def forward(self, q, k, v, kv_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None, sinks=None,
                attention_chunk=None):
        why = unsupported_features(kv_cache, sinks, attention_chunk)
        if why is not None:
            raise ValueError(f"attention backend 'flashinfer' does not support {why}; use --attention-backend "
                             f"torch or triton")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        wrapper = self._wrapper(q, k, kv_cache, meta, scale, sliding_window, logits_soft_cap)
        return wrapper.run(q, (kv_cache[0], kv_cache[1]))

"""Model runner: owns the model weights and this rank's paged KV cache, and runs forward passes.

The number of KV blocks comes from a memory budget (``worker/kv_cache_budget.py``); the cache is
allocated once, as one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (int8,
with the block's scales in a few more token rows, for ``--kv-cache-dtype int8``: ``kv_quant.py``);
[1, ...] where the model's keys are its values (``kv_shared``: multi-head latent attention).

Once the model is loaded, the platform of its device may supply a fused stack of its decoder layers
(the CPU layer runner: ``CpuPlatform.layer_stack``), set as ``model.layer_stack`` on a model that
has that hook; the model's forward calls it in place of its layer loop.

On CUDA, with a graph-safe attention backend and without ``--enforce-eager``, decode-only steps replay
CUDA graphs captured once the KV cache is allocated (``platforms/cuda/graph_runner.py``); the cache
then has one block more than the pool hands out, the scratch block that padding rows write.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from pagedllm import platforms
from pagedllm.config import EngineConfig
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq, kv_quant
from pagedllm.layers.attention.backend import attention_window
from pagedllm.layers.pooler import last_token_embeddings
from pagedllm.lora.runtime import LoRARuntime
from pagedllm.models.loader import load_model, load_vision_tower
from pagedllm.multimodal.encoder_cache import EncoderCache, MultiModalStep
from pagedllm.platforms.cuda.graph_runner import (CudaGraphRunner, DecodeBuffers, capture_sizes, graphs_off_reason,
                                                  torch_graph_factory)
from pagedllm.worker.model_input import ModelInput

logger = logging.getLogger("pagedllm")


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.platform().prepare_process()
        torch.manual_seed(config.model_config.seed)
        self.model = load_model(config.model_config, self.device, config.cache_config.block_size)
        self.lora: Optional[LoRARuntime] = None  # --enable-lora: the adapters' slots and hooks (pagedllm/lora/)
        if config.lora_config is not None:
            lc = config.lora_config
            self.lora = LoRARuntime(self.model, config.model_config.hf_config, lc.max_loras, lc.max_lora_rank,
                                    lc.max_cpu_loras, config.model_config.dtype, self.device, lc.op_mode)
        # An image-text model: its vision tower + projector, and the encoder outputs the engine keeps.
        self.vision = load_vision_tower(config.model_config, self.device)
        self.encoder_cache = EncoderCache()
        self.attach_layer_stack()
        self.platform().release_load_memory()  # loading's freed transients, before the KV cache is sized
        # A pipeline stage holds only its own layers (the others are parameter-less placeholders).
        self.start_layer = getattr(self.model, "start_layer", 0)
        self.end_layer = getattr(self.model, "end_layer", len(self.model.layers))
        attn = self.model.layers[self.start_layer].self_attn
        self.num_kv_heads = attn.num_kv_heads  # per rank
        self.head_dim = attn.head_dim
        # K and V planes: 1 where attention reads its values from the keys (MLA's latent)
        self.kv_planes = 1 if getattr(attn, "kv_shared", False) else 2
        self.attention_backend = attn.backend
        self.num_layers = self.end_layer - self.start_layer  # layers with a KV cache on this rank
        self.dtype = config.model_config.dtype
        int8 = config.cache_config.cache_dtype == "int8"
        self.kv_cache_dtype = torch.int8 if int8 else self.dtype
        self.kv_block_rows = kv_quant.block_rows(config.cache_config.block_size, self.head_dim,
                                                 config.cache_config.cache_dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.pooling = config.model_config.runner == "pooling"
        # CUDA graphs of decode steps: None = capture them once the KV cache is allocated, else why not.
        self.graphs_off: Optional[str] = graphs_off_reason(
            device=self.device, enforce_eager=config.model_config.enforce_eager,
            backend_name=self.attention_backend.name, world_size=config.parallel_config.world_size,
            pooling=self.pooling)
        if self.graphs_off is None and self.lora is not None:
            self.graphs_off = "LoRA adapters (the batched op's grouping changes every step)"
        spec = config.speculative_config
        if self.graphs_off is None and spec is not None and spec.method == "mtp":
            self.graphs_off = "speculative decoding's mtp method (every step returns the hidden states)"
        # () -> a maker of graph objects (capture(fn), replay()); tests put a fake graph's here
        self.graph_factory: Callable[[], Callable[[], Any]] = torch_graph_factory
        self.cuda_graphs: Optional[CudaGraphRunner] = None

    def platform(self) -> platforms.Platform:
        """The platform whose kernels run on this runner's device: ``current_platform``, or the CPU
        wing for a CPU device on a GPU host (``--device cpu``)."""
        if torch.device(self.device).type == "cpu" and not platforms.current_platform.is_cpu():
            return platforms.CpuPlatform()
        return platforms.current_platform

    def attach_layer_stack(self) -> None:
        """Set ``model.layer_stack`` (a model with that hook: Llama's family, Gemma's) to the platform's
        fused stack of its decoder layers, where the platform has one (``layer_stack(model)``: the CPU
        layer runner, which decides on its first call whether it covers the model)."""
        if hasattr(self.model, "layer_stack"):
            # under --enable-lora the stack adds the adapters itself (it calls no Python linear, so no
            # LoRA hook runs), or leaves the steps with adapter tokens to the loop
            stack = self.platform().layer_stack(self.model, self.lora)
            if stack is not None and getattr(self.vision, "bidirectional_image_attention", False):
                # (its C attention is causal; image embeddings themselves it takes as any input)
                logger.info("cpu layer runner (where it covers the model): steps with image tokens run the layer "
                            "loop (an image's tokens attend to each other both ways)")
            self.model.layer_stack = stack

    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.model.parameters():
            if p.numel() and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        # weights packed for oneDNN (opaque tensors without storage): counted at their float size
        return total + sum(getattr(m, "packed_bytes", 0) for m in self.model.modules())

    def bytes_per_block(self) -> int:
        """K and V of one block in every layer, on this rank."""
        return (self.kv_planes * self.num_layers * self.kv_block_rows * self.num_kv_heads * self.head_dim
                * self.kv_cache_dtype.itemsize)

    def sliding_windows(self) -> list[Optional[int]]:
        """The sliding window of each of this rank's layers, in tokens (None: whole context)."""
        return [attention_window(layer.self_attn) for layer in self.model.layers[self.start_layer:self.end_layer]]

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass of ``max_num_batched_tokens`` prompt tokens and logits for
        ``max_num_seqs`` rows, without a KV cache: the activation peak of a real step."""
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.config.model_config.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=self.device),
                                 prefills=[PrefillSeq(0, n, n)])
        hidden = self.model(ids, torch.arange(n, device=self.device), [None] * len(self.model.layers), meta)
        rows = min(n, self.config.scheduler_config.max_num_seqs)
        self.model.compute_logits(hidden[:rows])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # A backend that never reads unwritten slots needs no zero-fill (saves touching every page at
        # start); one that gathers padded slots needs finite values there (NaN * 0 is NaN).
        alloc = torch.zeros if self.attention_backend.needs_zeroed_cache else torch.empty
        scratch = int(self.graphs_off is None)  # block num_blocks: the graphs' padding rows write there
        self.kv_caches = [alloc(self.kv_planes, num_blocks + scratch, self.kv_block_rows, self.num_kv_heads,
                                self.head_dim, dtype=self.kv_cache_dtype, device=self.device)
                          if self.start_layer <= i < self.end_layer else None
                          for i in range(len(self.model.layers))]
        if scratch:
            self.capture_cuda_graphs(pad_block=num_blocks)
        elif torch.device(self.device).type == "cuda":
            logger.info("CUDA graphs off: %s", self.graphs_off)

    def capture_cuda_graphs(self, pad_block: int) -> None:
        """Capture the decode graphs of ``capture_sizes(max_num_seqs)`` (``self.cuda_graphs``); logs one
        line with their sizes, capture time and memory. A capture that fails leaves graphs off (logged)."""
        sc, bs = self.config.scheduler_config, self.config.cache_config.block_size
        cuda = torch.device(self.device).type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        sizes = capture_sizes(sc.max_num_seqs)
        max_len = self.config.model_config.max_model_len
        buffers = DecodeBuffers(sizes[-1], -(-max_len // bs), bs, pad_block, self.device)

        def forward(b: int) -> torch.Tensor:  # the model on the first b rows of the buffers
            meta = AttentionMetadata(slot_mapping=buffers.slot_mapping[:b], num_decode_tokens=b,
                                     block_tables=buffers.block_tables[:b], seq_lens=buffers.seq_lens[:b],
                                     query_start_loc=buffers.query_start_loc[:b + 1], block_size=bs,
                                     max_decode_seq_len=max_len)
            return self.model(buffers.input_ids[:b], buffers.positions[:b], self.kv_caches, meta)

        runner = CudaGraphRunner(sizes, buffers, forward, self.graph_factory())
        try:
            with torch.inference_mode():
                runner.capture()
        except Exception as e:  # noqa: BLE001 - a model or backend that cannot be captured runs eagerly
            self.graphs_off = f"capture failed ({type(e).__name__}: {e})"
            logger.warning("CUDA graphs off: %s", self.graphs_off)
            return
        if cuda:
            torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        self.cuda_graphs = runner
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.2f s, %.1f MiB; prefills and "
                    "batches over %d run eagerly (--enforce-eager turns graphs off)", len(sizes),
                    ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}",
                    runner.capture_seconds, used / 2**20, sizes[-1])

    def compute_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows the engine asked for (``logits_indices``) -> float32 logits [M, vocab_size], or
        under the pooling runner their embeddings [M, hidden_size] (``layers/pooler.py``)."""
        return last_token_embeddings(hidden) if self.pooling else self.model.compute_logits(hidden)

    def embed_with_images(self, model_input: ModelInput) -> torch.Tensor:
        """The step's input embeddings [N, hidden]: the token embeddings, with the rows of image
        placeholder tokens replaced by their images' encoder outputs (encoded now, or kept from an
        earlier step: ``model_input.mm``)."""
        mm: MultiModalStep = model_input.mm
        self.encoder_cache.apply(mm, self.vision, self.device)
        ids = model_input.input_ids
        if mm.scatter:  # (a placeholder id may lie outside the text vocabulary: Gemma 3's real one may)
            ids = ids.clone()
            for _, dst, _, n in mm.scatter:
                ids[dst:dst + n] = 0
        x = self.model.embed_input(ids)
        for ident, dst, src, n in mm.scatter:
            emb = self.encoder_cache.embeddings(ident)
            if emb is None:
                raise RuntimeError(f"image {ident[:12]} is neither encoded in this step nor cached")
            x[dst:dst + n] = emb[src:src + n].to(x.dtype)
        return x

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput) -> Any:
        """One forward pass; returns ``compute_output`` of the rows ``logits_indices`` names, or under
        ``return_hidden`` (that, every token's final hidden states [N, hidden]), run without CUDA graphs."""
        if model_input.block_copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*model_input.block_copies))
            for cache in self.kv_caches[self.start_layer:self.end_layer]:
                cache[:, dst] = cache[:, src]
        if self.lora is not None:
            self.lora.prepare(model_input.lora)
        if model_input.mm is not None:  # image tokens in the step: their embeddings scattered in
            hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches,
                                model_input.attn_metadata, inputs_embeds=self.embed_with_images(model_input))
        else:
            if (model_input.logits_all_rows and not model_input.return_hidden and not self.pooling
                    and self.lora is None and self.cuda_graphs is None):
                # a plain decode step, LM head included, in one call where the model has one (Llama's
                # family on the CPU layer runner: StepTokens.lm_head); the same values as below
                step_logits = getattr(self.model, "step_logits", None)
                logits = None if step_logits is None else step_logits(
                    model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata)
                if logits is not None:
                    return logits
            # a decode-only step replays its graph (None: it runs eagerly); not where the hidden states are returned
            if self.cuda_graphs is not None and not model_input.return_hidden:
                meta = model_input.attn_metadata
                rows = self.cuda_graphs.run(model_input.input_ids, model_input.positions, meta.slot_mapping,
                                            meta.block_tables, meta.seq_lens, meta.num_decode_tokens,
                                            model_input.logits_indices)
                if rows is not None:  # the hidden states of the rows asked for
                    return self.compute_output(rows)
            hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches,
                                model_input.attn_metadata)
        out = self.compute_output(hidden if model_input.logits_all_rows else hidden[model_input.logits_indices])
        return (out, hidden) if model_input.return_hidden else out

"""Pipeline-parallel model runner: this rank's stage of the layers (Huang et al., 2019, "GPipe";
vLLM's ``PPMissingLayer``/``IntermediateTensors`` scheme).

Every rank receives the same ModelInput (the executor broadcasts it). Stage 0 embeds the tokens;
each stage runs its layers over its own KV cache and sends the hidden states and the residual
stream (each [N, hidden]) to the same TP rank of the next stage with ``torch.distributed``
point-to-point ``send``/``recv`` (gloo on a CPU, NCCL on CUDA); the last stage applies the final
norm and the LM head, and its TP rank 0 sends the float32 logits [M, vocab] back to global rank 0
(the driver). Shapes are known on every rank from the ModelInput, so no shape message precedes a
tensor.

Several batches are in flight at once (vLLM V1's ``batch_queue``): ``execute_model_async`` on the
driver runs stage 0, hands the hidden states to stage 1, posts an ``irecv`` for the logits and
returns a ``PendingLogits``, so the engine can put batch i+1 into stage 0 while stages 1..P-1 work
on batch i (up to P batches, one per stage; the scheduler skips requests whose batch is in
flight, see engine/scheduler.py). Every stage runs the batches in the order the driver sent them,
and each pair of ranks sees its sends and receives in the same order, so FIFO matching needs no
tags (NCCL has none). The engine samples each batch when its logits arrive, oldest first.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import (get_pp_rank, get_pp_size, get_tp_rank, get_tp_size, pp_recv,
                                                 pp_send)
from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.worker.model_input import ModelInput
from pagedllm.worker.model_runner import ModelRunner


def check_pp_support(model_cls: type) -> None:
    """Raise ValueError unless the model's forward takes the previous stage's tensors."""
    if not getattr(model_cls, "supports_pp", False) or \
            "intermediate" not in inspect.signature(model_cls.forward).parameters:
        raise ValueError(f"pipeline parallelism is not implemented for {model_cls.__name__} (its forward does "
                         f"not take the previous stage's tensors); use --pipeline-parallel-size 1")


class PendingLogits:
    """Logits [M, vocab] (float32) on their way from the last stage to the driver."""

    def __init__(self, work, logits: torch.Tensor) -> None:
        self._work, self._logits = work, logits

    def done(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        """Block until the logits are here (bounded by the process group's timeout); raises
        RuntimeError when the last stage is gone."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._logits


class PPModelRunner(ModelRunner):
    """``execute_model`` returns the logits on global rank 0 (and on the last stage), None on
    the other ranks; ``execute_model_async`` returns a PendingLogits on rank 0 instead."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        check_pp_support(type(self.model))
        self.pp_rank, self.pp_size = get_pp_rank(), get_pp_size()
        self.first, self.last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.hidden_size = config.model_config.hf_config.hidden_size
        # width of the last stage's output rows: logits, or embeddings under the pooling runner
        hf = config.model_config.hf_config
        self.vocab_size = hf.hidden_size if config.model_config.runner == "pooling" else hf.vocab_size

    def _intermediate(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden states, residual stream) from the previous stage; None on the first."""
        if self.first:
            return None
        return tuple(pp_recv((n, self.hidden_size), self.dtype, self.device, self.pp_rank - 1) for _ in range(2))

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The activation peak of a real step on this stage, without communication (stages profile
        at the same time; a stand-in input of zeros has the received tensor's size)."""
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.config.model_config.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=self.device), prefills=[PrefillSeq(0, n, n)])
        inter = None if self.first else \
            tuple(torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.device) for _ in range(2))
        hidden = self.model(ids, torch.arange(n, device=self.device), [None] * len(self.model.layers), meta,
                            intermediate=inter)
        if self.last:
            self.model.compute_logits(hidden[:min(n, self.config.scheduler_config.max_num_seqs)])

    def execute_model(self, model_input: ModelInput) -> torch.Tensor | None:
        out = self.execute_model_async(model_input)
        return out.wait() if isinstance(out, PendingLogits) else out

    @torch.inference_mode()
    def execute_model_async(self, model_input: ModelInput) -> torch.Tensor | PendingLogits | None:
        if model_input.block_copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*model_input.block_copies))
            for cache in self.kv_caches[self.start_layer:self.end_layer]:
                cache[:, dst] = cache[:, src]
        n = model_input.input_ids.shape[0]
        if self.lora is not None:  # this stage's LoRA slots and the step's grouping (pagedllm/lora/)
            self.lora.prepare(model_input.lora)
        hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata,
                            intermediate=self._intermediate(n))
        m = model_input.logits_indices.shape[0]
        if not self.last:
            for t in hidden:  # (hidden states, residual stream)
                pp_send(t, self.pp_rank + 1)
            if self.first and get_tp_rank() == 0:
                logits = torch.empty(m, self.vocab_size, dtype=torch.float32, device=self.device)
                return PendingLogits(dist.irecv(logits, (self.pp_size - 1) * get_tp_size()), logits)
            return None
        logits = self.compute_output(hidden[model_input.logits_indices])
        if get_tp_rank() == 0:
            dist.send(logits.contiguous(), 0)
        return logits

"""Executors run the model runner(s): in this process (tensor_parallel_size 1) or on one worker
process per rank (``worker/multiproc_executor.py``). The engine only talks to this interface."""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import get_pp_state, get_tp_rank, get_tp_size, set_pp_state, set_tp_state
from pagedllm.worker.model_input import ModelInput
from pagedllm.worker.kv_cache_budget import kv_cache_budget_bytes
from pagedllm.worker.model_runner import ModelRunner


class ModelOutputFuture:
    """The logits [M, V] (float32) of a batch handed to ``Executor.execute_model_async``."""

    def __init__(self, logits: torch.Tensor | None = None) -> None:
        self._logits = logits

    def done(self) -> bool:
        return True

    def result(self) -> torch.Tensor:
        """Wait for the logits; raises RuntimeError when a worker died."""
        return self._logits


class Executor:
    """determine_kv_budget() -> (bytes per rank, explanation); bytes_per_block() per rank;
    allocate_kv_cache(num_blocks); execute_model(ModelInput) -> logits [M, V] (float32).

    ``max_concurrent_batches`` (vLLM's name) batches may be in flight at once through
    ``execute_model_async``: more than 1 only with pipeline parallelism, where the engine keeps
    one batch per stage (the default runs the batch to the end before returning)."""

    max_concurrent_batches = 1

    def determine_kv_budget(self) -> tuple[int, str]:
        raise NotImplementedError

    def bytes_per_block(self) -> int:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        raise NotImplementedError

    def sliding_windows(self) -> list[Optional[int]]:
        """The sliding window of every layer (None: whole context), over every rank's layers."""
        raise NotImplementedError

    def allocate_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, model_input: ModelInput) -> torch.Tensor:
        raise NotImplementedError

    def execute_model_async(self, model_input: ModelInput) -> ModelOutputFuture:
        return ModelOutputFuture(self.execute_model(model_input))

    def check_health(self) -> None:
        """Raise RuntimeError if a worker died."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Build an unsharded model even if a tensor-parallel engine lives in this process too
        # (layers read the TP size once, at construction).
        if config.parallel_config.num_threads and not config.device.startswith("cuda"):
            torch.set_num_threads(config.parallel_config.num_threads)  # see platforms/cpu/threads.py
        prev, prev_pp = (get_tp_rank(), get_tp_size()), get_pp_state()
        set_tp_state(0, 1)
        set_pp_state(0, 1)
        try:
            self.runner = ModelRunner(config)
        finally:
            set_tp_state(*prev)
            set_pp_state(*prev_pp)

    def determine_kv_budget(self) -> tuple[int, str]:
        cc = self.config.cache_config
        return kv_cache_budget_bytes(self.config.device, cc.gpu_memory_utilization, cc.kv_cache_memory,
                                     self.runner.profile_run, cc.cpu_kv_cache_space, cc.cpu_kv_cache_space_reason)

    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()

    def weight_bytes(self) -> int:
        return self.runner.weight_bytes

    def sliding_windows(self) -> list[Optional[int]]:
        return self.runner.sliding_windows()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, model_input: ModelInput) -> torch.Tensor:
        return self.runner.execute_model(model_input)

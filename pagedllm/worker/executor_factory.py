"""Which executor runs the model: one process, worker processes (``multiproc_executor.py``), or
Ray actors (``ray_executor.py``), from the parallel settings."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.worker.executor import Executor, UniProcExecutor
from pagedllm.worker.multiproc_executor import MultiprocExecutor


def make_executor(config: EngineConfig) -> Executor:
    """The executor for ``config``: Ray when ``distributed_executor_backend`` is "ray" and the world
    has more than one rank, worker processes for any other world of several ranks, else this process."""
    if config.parallel_config.world_size > 1 and config.parallel_config.distributed_executor_backend == "ray":
        from pagedllm.worker.ray_executor import RayExecutor  # lazily: ray is an optional extra

        return RayExecutor(config)
    if config.parallel_config.world_size > 1:
        return MultiprocExecutor(config)
    return UniProcExecutor(config)

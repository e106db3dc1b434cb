"""Data parallelism (vLLM's ``--data-parallel-size``): N engine core processes behind one
``AsyncLLM`` interface. It is the engine-core client (``engine/core_client.py``) with N cores;
this module keeps the names the data-parallel code was first written under."""
from __future__ import annotations

from pagedllm.engine.core_client import (CoreClient, FrontEngine, _Replica, combine_snapshots,  # noqa: F401
                                         replica_devices, replica_threads)

DPAsyncLLM = CoreClient

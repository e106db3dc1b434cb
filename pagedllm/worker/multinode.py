"""Multi-node launch with the multiprocessing backend (vLLM's ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``, ``--headless``).

Every node runs ``pagedllm serve MODEL --nnodes N --node-rank R --master-addr A --master-port P``
with the same engine flags. World = TP x PP ranks; node R runs global ranks [R * L, (R + 1) * L),
L = world / N, so a TP group of L ranks or fewer stays inside one node and pipeline stages span
nodes (as vLLM lays them out). Node 0 holds the driver (rank 0, scheduler, HTTP server) and hosts
the ``torch.distributed`` rendezvous at A:P; the others run ``--headless``: worker processes
only, which join that rendezvous and serve the driver's broadcast calls
(``worker/multiproc_executor.py``).

Failure: a headless node exits (non-zero) as soon as one of its ranks exits -- e.g. when node 0
dies, its ranks' next collective fails on the closed sockets -- and it stops its other ranks. The
driver pings the remote ranks whenever it is idle for 2 s, so a dead node turns /health 503
within seconds (a network partition, where no socket closes, is bounded by the rendezvous and
collective timeout PAGEDLLM_TP_TIMEOUT_S instead). On a clean stop node 0 tells every rank to
exit, and headless nodes exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.worker.multiproc_executor import threads_per_rank, validate_tensor_parallel, worker_main

logger = logging.getLogger("pagedllm")


def run_headless(config: EngineConfig) -> int:
    """Run this node's ranks until they exit; returns the process exit code (0 when node 0
    stopped them cleanly, 1 when one failed or the driver vanished)."""
    pc = config.parallel_config
    if pc.node_rank == 0:
        raise ValueError("--headless runs worker ranks only; node 0 runs the driver and the API server "
                         "(use --node-rank >= 1)")
    validate_tensor_parallel(config.model_config.hf_config, pc.tensor_parallel_size)
    world, local = pc.world_size, pc.world_size // pc.nnodes
    ranks = list(range(pc.node_rank * local, (pc.node_rank + 1) * local))
    init_method = f"tcp://{pc.master_addr}:{pc.master_port}"
    threads = threads_per_rank(local) if not config.device.startswith("cuda") else 1
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    stop = {"signal": False}

    def on_signal(signum, frame):
        stop["signal"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in ranks:
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, name=f"pagedllm-rank{rank}", daemon=True,
                            args=(config, rank, world, init_method, send, os.getpid(), threads))
            p.start()
            send.close()
            procs.append((p, recv))
        logger.info("headless node %d of %d: ranks %s (pids %s) joining %s", pc.node_rank, pc.nnodes, ranks,
                    [p.pid for p, _ in procs], init_method)
        while not stop["signal"]:
            done = [p for p, _ in procs if not p.is_alive()]
            if done:
                codes = [p.exitcode for p in done]
                failed = any(c != 0 for c in codes)
                if failed:
                    logger.error("headless node %d: rank process(es) %s exited with %s; stopping the others",
                                 pc.node_rank, [p.pid for p in done], codes)
                else:  # a clean stop reaches every rank at once: give the others a moment
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline and any(p.is_alive() for p, _ in procs):
                        time.sleep(0.05)
                    failed = any(p.exitcode not in (0, None) for p, _ in procs)
                    logger.info("headless node %d: stopped by node 0", pc.node_rank)
                return 1 if failed else 0
            time.sleep(0.2)
        return 0
    finally:
        for p, conn in procs:
            if p.is_alive():
                p.terminate()
        for p, conn in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
            conn.close()
        for s, h in old.items():
            signal.signal(s, h)

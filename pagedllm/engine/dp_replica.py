"""One data-parallel engine replica: a process that owns a full ``LLMEngine`` (its own model
copy, KV cache and torch threads) and serves the front end (``engine/dp_client.py``) over one
duplex ``multiprocessing`` pipe. Only small pickles cross the pipe (prompts as token ids,
sampling params, RequestOutputs, counters); no tensor but the pooling runner's embeddings ([hidden] each).

Messages front -> replica: ("add", request_id, prompt, params, arrival_time, priority), ("abort", request_id),
("shutdown",). Replica -> front: ("ready", info), ("out", outputs, snapshot), ("snap", snapshot),
("reject", request_id, message), ("dead", reason), ("start_error", message, is_value_error).

The replica exits when the front end goes away (EOF on the pipe, or its parent pid changes), so a
SIGKILLed server leaves no replica behind; a replica whose engine fails reports "dead" and exits 1.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

import torch

from pagedllm.engine.async_engine import EngineSnapshot
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.logger import init_logger
from pagedllm.worker.multiproc_executor import _watch_parent

logger = logging.getLogger("pagedllm")

_IDLE_HEALTH_CHECK_S = 2.0


def replica_main(engine_args: Any, index: int, num_threads: int, conn: Any, parent_pid: int,
                 log_level: str = "INFO", visible_devices: str | None = None) -> None:
    """Entry point of a spawned replica process (never returns: exits the process).
    ``visible_devices``: this replica's GPUs (CUDA_VISIBLE_DEVICES), set before CUDA starts."""
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end handles Ctrl-C and tells us to stop
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    # Tensor-parallel workers of this replica (spawned later) share its cores, not the machine's.
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    init_logger(log_level)
    try:
        engine = LLMEngine.from_engine_args(engine_args, log_stats=True)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which prints it
        conn.send(("start_error", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e),
                   isinstance(e, (ValueError, OSError))))
        os._exit(1)
    cc = engine.config.cache_config
    conn.send(("ready", {"pid": os.getpid(), "num_blocks": cc.num_blocks, "threads": num_threads}))
    logger.info("data-parallel replica %d: pid %d, %d threads, %d KV blocks", index, os.getpid(), num_threads,
                cc.num_blocks)
    _ReplicaLoop(engine, conn).run()


class _ReplicaLoop:
    def __init__(self, engine: Any, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.lock = threading.Lock()
        self.inbox: list[tuple] = []
        self.wake = threading.Event()
        threading.Thread(target=self._receive, daemon=True, name="dp-receive").start()

    def _receive(self) -> None:
        """Move the front end's messages into the inbox as they come (even mid-step)."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(1)  # the front end is gone: nobody can read our outputs
            with self.lock:
                self.inbox.append(msg)
            self.wake.set()

    def snapshot(self) -> Any:
        e = self.engine
        return EngineSnapshot(e.get_stats(), e.num_prompt_tokens_total, e.num_generation_tokens_total)

    def _drain(self) -> bool:
        """Apply queued adds/aborts; False once told to shut down."""
        with self.lock:
            msgs, self.inbox = self.inbox, []
        for msg in msgs:
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params, arrival, priority = msg
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival, priority=priority)
                except Exception as e:  # noqa: BLE001 - a bad request must not stop the replica
                    self.conn.send(("reject", rid, str(e) if isinstance(e, ValueError) else
                                    f"{type(e).__name__}: {e}"))
            elif kind == "abort":
                if msg[1] in self.engine.output_processor.states:
                    self.engine.abort_request(msg[1])  # frees its KV blocks now
            elif kind == "shutdown":
                return False
        return True

    def run(self) -> None:
        engine = self.engine
        last_health = time.monotonic()
        sent_idle = False
        try:
            while True:
                self.wake.clear()
                if not self._drain():
                    break
                if not engine.has_unfinished_requests():
                    if not sent_idle:  # one snapshot after the last step shows the emptied pool
                        self.conn.send(("snap", self.snapshot()))
                        sent_idle = True
                    self.wake.wait(_IDLE_HEALTH_CHECK_S)
                    if time.monotonic() - last_health >= _IDLE_HEALTH_CHECK_S:
                        last_health = time.monotonic()
                        engine.check_health()
                    continue
                sent_idle = False
                outputs = engine.step()
                self.conn.send(("out", outputs, self.snapshot()))
        except BaseException as e:  # noqa: BLE001 - report, then die loudly
            msg = f"{type(e).__name__}: {e}"
            logger.error("data-parallel replica failed: %s\n%s", msg, traceback.format_exc())
            try:
                self.conn.send(("dead", msg))
            except Exception:  # noqa: BLE001 - the front end may be gone
                pass
            self._exit(1)
        self._exit(0)

    def _exit(self, code: int) -> None:
        try:
            self.engine.shutdown()
        finally:
            os._exit(code)

"""The async front end over ``LLMEngine``: many asyncio callers, one engine loop thread.

The engine loop runs in its own thread so a forward pass never blocks the HTTP event loop.
Hand-off is one lock-protected inbox (new requests, aborts) that the engine thread drains
between steps; outputs go back to each caller's mailbox (newest output + an asyncio.Event)
through ``loop.call_soon_threadsafe``, one callback per event loop per step. When there is
nothing to run, the thread sleeps on an Event (no busy spin).

    llm = AsyncLLM(engine); llm.start()
    async for out in llm.generate(prompt, SamplingParams(...), "req-1"):
        ...                      # cumulative RequestOutputs; the last has .finished
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.scheduler import SchedulerStats
from pagedllm.lora.request import LoRARequest
from pagedllm.engine.speculator import SpecDecodeStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.platforms.cpu.threads import release_openmp_threads

logger = logging.getLogger("pagedllm")

_HEALTH_CHECK_INTERVAL_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, a worker died, or the engine shut down)."""


@dataclass
class EngineSnapshot:
    """Engine counters as of the end of the last engine-thread iteration (read by /metrics)."""

    stats: SchedulerStats
    prompt_tokens_total: int
    generation_tokens_total: int
    num_blocks: int = 0                # KV blocks requests can hold (0: not reported)
    num_free_blocks: int = 0           # free, including the cached evictable ones
    num_cached_free_blocks: int = 0    # free but holding prefix-cached K/V
    # Data parallelism: one snapshot per replica (the fields above are then their totals).
    replicas: Optional[list["EngineSnapshot"]] = None
    # Speculative decoding's counters (a copy; None when it is off): engine/speculator.py SpecDecodeStats
    spec_decode: Optional[SpecDecodeStats] = None


# Delivered instead of a RequestOutput by a front end that builds a running request's output when its
# caller reads it (CoreClient, for a caller that has not taken the last one yet: each step would build
# one only for the next to replace it); ``generate`` then asks ``_lazy_output`` for the newest one.
LAZY_OUTPUT = object()


class _Stream:
    """One caller's mailbox on its event loop. Outputs are cumulative, so only the newest
    undelivered one is kept: a slow reader never makes the server buffer more than one output."""

    __slots__ = ("loop", "event", "latest", "error", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.latest: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None
        self.finished = False

    def push(self, item: Any) -> None:  # runs on ``loop``
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.latest = item
        self.event.set()


class AsyncLLM:
    """Thread-backed async wrapper of an ``LLMEngine``.

    ``on_outputs(outputs)`` and ``on_abort(request_id, finish_reasons)`` (one per choice; None
    where it was aborted), if given, are called from the engine
    thread (used by the Prometheus metrics); so is ``on_step(engine, stepped)``, after every step
    (``stepped`` True) and before the loop idles (False), between steps (used by the dashboard).
    """

    def __init__(self, engine: LLMEngine,
                 on_outputs: Optional[Callable[[list[RequestOutput]], None]] = None,
                 on_abort: Optional[Callable[[str, list[Optional[str]]], None]] = None) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_abort = on_abort
        self.on_step: Optional[Callable[[LLMEngine, bool], None]] = None
        self._lock = threading.Lock()
        self._new: list[tuple[str, Any, SamplingParams, float]] = []
        self._aborts: list[str] = []
        self._loras: dict[str, LoRARequest] = {}  # request id -> its LoRA adapter, until the engine takes it
        self._aborts_notify: list[str] = []  # aborted with a final "abort" output to their callers
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.errored = False
        self.dead_reason: Optional[str] = None
        self.snapshot = self._take_snapshot()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(args, log_stats=True), **kwargs)

    # ---- convenience accessors -----------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> "AsyncLLM":
        if self._thread is None:
            # The engine thread runs every forward pass from here on; this thread's idle OpenMP
            # workers would only make the engine's sleep between parallel regions
            # (platforms/cpu/threads.py).
            if release_openmp_threads():
                logger.debug("released the OpenMP threads of %s", threading.current_thread().name)
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0, shutdown_engine: bool = True) -> None:
        """Stop the engine thread (pending requests get EngineDeadError) and, with
        ``shutdown_engine``, the engine and its workers. Idempotent."""
        with self._lock:
            already = self._stop
            self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if not already and shutdown_engine:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                logger.exception("engine shutdown failed")

    def check_health(self) -> bool:
        """True while the engine is alive; False (and ``errored`` set) once it died."""
        if not self.errored:
            try:
                self.engine.check_health()
            except Exception as e:  # noqa: BLE001
                self._mark_dead(f"engine worker died: {e}")
        return not self.errored

    # ---- caller side (asyncio) -----------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str, priority: int = 0,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs of one request as the engine produces them.
        ``lora_request``: the LoRA adapter it runs with (None: the base model).

        Raises ValueError when the engine rejects the request, EngineDeadError when the engine
        stops (or is gone already). Closing or cancelling the iterator before the last output aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self.errored or self._stop:
                raise EngineDeadError(self.dead_reason or "the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            if lora_request is not None:
                self._loras[request_id] = lora_request
            try:
                self._submit(request_id, prompt, params, time.time(), priority)
            except BaseException:
                del self._streams[request_id]
                self._loras.pop(request_id, None)
                raise
        self._wake.set()
        read = 0  # tokens (all samples) of the newest output yielded
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                item, stream.latest = stream.latest, None
                if item is not None:
                    self._taken(request_id)
                if item is LAZY_OUTPUT:
                    item = self._lazy_output(request_id)  # None: it finished meanwhile; the final is on its way
                if item is not None and not item.finished:
                    # A step's output built before a lazy one that was read first is older than what was
                    # yielded: outputs are cumulative, so it adds nothing (and would step back).
                    count = sum(len(c.token_ids) for c in item.outputs)
                    if count < read:
                        item = None
                    else:
                        read = count
                if item is not None:
                    stream.finished = item.finished
                    yield item
                    if stream.finished:
                        return
                if stream.error is not None:
                    stream.finished = True
                    raise stream.error
        finally:
            if not stream.finished:
                self.abort(request_id)
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]

    def _submit(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival: float,
                priority: int = 0) -> None:
        """Hand a new request to the engine (called with ``_lock`` held; the data-parallel
        front end overrides it to route the request to a replica)."""
        self._new.append((request_id, prompt, params, arrival, priority))

    def _taken(self, request_id: str) -> None:
        """Its caller has taken ``request_id``'s newest output (caller side; no lock)."""

    def _lazy_output(self, request_id: str) -> Optional[RequestOutput]:
        """The newest output of a request that was delivered ``LAZY_OUTPUT`` (caller side); this engine
        loop never delivers that."""
        return None

    def register_lora(self, lora_request: LoRARequest) -> None:
        """Serve an adapter already read and checked (``serving_models``): the engine does not read it
        again (dict assignment is atomic for the engine thread); the runner reads its weights the first
        step that needs them."""
        self.engine.checked_loras[lora_request.lora_int_id] = lora_request

    def unregister_lora(self, lora_int_id: int) -> None:
        """An adapter unloaded: new requests cannot name it; those running with it finish with it."""
        self.engine.checked_loras.pop(lora_int_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from any thread); its KV blocks are freed before the next step."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        """End every request in flight (safe from any thread): each caller gets a final output with
        finish_reason "abort" (a streaming client its last chunk), and one log line per request.
        Used at shutdown after ``--shutdown-timeout``. Returns how many were in flight."""
        with self._lock:
            ids = [rid for rid, st in self._streams.items() if not st.finished]
            self._aborts_notify.extend(ids)
        self._wake.set()
        return len(ids)

    # ---- engine thread -------------------------------------------------------------------
    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        pool = e.kv_cache_manager.block_pool
        return EngineSnapshot(e.get_stats(), e.num_prompt_tokens_total, e.num_generation_tokens_total,
                              pool.num_usable_blocks, pool.get_num_free_blocks(), pool.num_cached_free_blocks,
                              spec_decode=e.speculator.stats.copy() if e.speculator is not None else None)

    def _drain_inbox(self) -> None:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            notify, self._aborts_notify = self._aborts_notify, []
        for request_id, prompt, params, arrival, priority in new:
            try:
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival, priority=priority,
                                        lora_request=self._loras.pop(request_id, None))
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the loop
                err = e if isinstance(e, ValueError) else ValueError(f"{type(e).__name__}: {e}")
                self._deliver({request_id: err})
        at_exit: list[str] = []  # requests aborted at shutdown: one log line for all of them
        for request_id, at_shutdown in [(r, False) for r in aborts] + [(r, True) for r in notify]:
            if request_id not in self.engine.output_processor.states:
                continue
            finals = self.engine.abort_request(request_id)
            if at_shutdown and finals:
                at_exit.append(f"{request_id} ({sum(len(c.token_ids) for c in finals[0].outputs)} generated tokens)")
                self._deliver({request_id: finals[0]})
            if self.on_abort is not None:
                try:  # each choice's finish reason (None: aborted)
                    self.on_abort(request_id, [c.finish_reason for c in finals[0].outputs] if finals else [None])
                except Exception:  # noqa: BLE001 - metrics must never stop serving
                    logger.exception("metrics update failed")
        if at_exit:
            logger.warning("aborted %d request(s) at shutdown: %s%s", len(at_exit), ", ".join(at_exit[:8]),
                           f" and {len(at_exit) - 8} more" if len(at_exit) > 8 else "")

    def _run(self) -> None:
        last_health = time.monotonic()
        try:
            while not self._stop:
                self._wake.clear()
                self._drain_inbox()
                if self._stop:
                    break
                if not self.engine.has_unfinished_requests():
                    self.snapshot = self._take_snapshot()
                    self._notify_step(False)
                    self._wake.wait(_HEALTH_CHECK_INTERVAL_S)
                    if time.monotonic() - last_health >= _HEALTH_CHECK_INTERVAL_S:
                        last_health = time.monotonic()
                        self.engine.check_health()
                    continue
                outputs = self.engine.step()
                self.snapshot = self._take_snapshot()
                self._notify_step(True)
                if outputs:
                    if self.on_outputs is not None:
                        try:
                            self.on_outputs(outputs)
                        except Exception:  # noqa: BLE001 - metrics must never stop serving
                            logger.exception("metrics update failed")
                    self._deliver({o.request_id: o for o in outputs})
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine loop died")
            self._mark_dead(f"engine loop died: {type(e).__name__}: {e}")
            return
        self._mark_dead("the engine is shutting down", errored=False)

    def _notify_step(self, stepped: bool) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine, stepped)
            except Exception:  # noqa: BLE001 - the dashboard must never stop serving
                logger.exception("step hook failed")

    def wake(self) -> None:
        """Make the engine loop run one iteration now (e.g. to take a snapshot while idle)."""
        self._wake.set()

    def _mark_dead(self, reason: str, errored: bool = True) -> None:
        """Fail every pending request; with ``errored`` /health turns 503."""
        if errored:
            self.errored = True
        self.dead_reason = self.dead_reason or reason
        with self._lock:
            self._stop = True
            pending = list(self._streams)
            self._new.clear()
        self._deliver({rid: EngineDeadError(reason) for rid in pending})

    def _deliver(self, items: dict[str, Any]) -> None:
        """Hand outputs/exceptions to their callers' event loops (one callback per loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for rid, item in items.items():
                stream = self._streams.get(rid)
                if stream is not None:
                    by_loop[stream.loop].append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed
                pass


def _put_all(batch: list) -> None:
    for stream, item in batch:
        stream.push(item)

"""The engine core in its own process (vLLM V1's ``EngineCoreProc``): an ``LLMEngine`` that
schedules and runs the model in a busy loop, fed and drained over ZeroMQ by the API server process
(``engine/core_client.py``), which tokenizes, detokenizes, matches stop strings and streams.

Loop: take every queued message (adds, aborts, stops; without blocking while requests run), step,
push one ``StepOutputs`` (token-id deltas and the counters /metrics reads); with nothing to run,
block on the input socket (health-checking the workers every 2 s). Messages are msgspec Structs
(``engine/core_protocol.py``); nothing is pickled after start-up.

The core never detokenizes: ``DeltaCollector`` stands in for the engine's output processor and
turns each step's advanced requests into deltas. A stop string is found in the front end, which
then sends ``StopSequences`` so the core finishes those samples (and frees their blocks) before
its next step; the at most one step of tokens generated meanwhile is dropped by the front end.

The core exits when the front end goes away (its parent pid changes), so a SIGKILLed server
leaves no core behind; a core whose engine fails reports ``Dead`` and exits 1.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Any, Optional

import torch
import zmq

from pagedllm.engine import core_protocol as P
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.logger import init_logger
from pagedllm.worker.multiproc_executor import _watch_parent

logger = logging.getLogger("pagedllm")

_IDLE_HEALTH_CHECK_S = 2.0


def _logprob_rows(position: Optional[dict]) -> Optional[list]:
    if position is None:
        return None
    return [(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in position.items()]


class _Sent:
    __slots__ = ("tokens", "logprobs", "finished", "prompt_logprobs", "plain")

    def __init__(self, n: int, plain: bool = False) -> None:
        self.tokens = [0] * n        # output tokens already sent, per sample
        self.logprobs = [0] * n      # logprob positions already sent, per sample
        self.finished = [False] * n
        self.prompt_logprobs = False
        # one sample, no logprobs, no prompt logprobs, not pooled: DeltaCollector._plain_delta
        self.plain = plain


class DeltaCollector(OutputProcessor):
    """The engine's output processor in the core: no detokenization, no stop strings (the front
    end does both); ``make_output(request_id)`` returns a ``RequestDelta`` of what changed since
    the last one. Logprob entries keep their token text (decoded here, cached per token id), as
    the in-process engine makes them."""

    def __init__(self, tokenizer, pooling: bool = False) -> None:
        super().__init__(tokenizer)
        self.pooling = pooling  # the pooling runner's requests carry an embedding: never the plain path
        self._sent: dict[str, _Sent] = {}
        self._changed: set[str] = set()

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    children: list[Request]) -> None:
        self.states[request_id] = _CoreState(children)  # (no detokenizers)
        sp = children[0].sampling_params
        self._sent[request_id] = _Sent(len(children), plain=len(children) == 1 and sp.logprobs is None
                                       and sp.prompt_logprobs is None and not self.pooling)

    def process(self, updated: list[Request], defer: bool = False) -> list[str]:
        return []

    def make_output(self, request_id: str) -> Optional[P.RequestDelta]:
        state = self.states.get(request_id)
        if state is None:
            return None
        sent = self._sent[request_id]
        if sent.plain:
            return self._plain_delta(request_id, state.children[0], sent)
        seqs = []
        for req in state.children:
            i = req.index
            finished = req.is_finished
            out = req.output_token_ids
            if len(out) == sent.tokens[i] and finished == sent.finished[i]:
                continue
            new = out[sent.tokens[i]:]
            sent.tokens[i] = len(out)
            sent.finished[i] = finished
            lps = None
            if req.sampling_params.logprobs is not None:
                lps = [_logprob_rows(p) for p in req.logprobs[sent.logprobs[i]:]]
                sent.logprobs[i] = len(req.logprobs)
            m = req.metrics
            seqs.append(P.SeqDelta(i, new, req.status.finish_reason if finished else None,
                                   req.stop_reason if finished else None, lps, float(req.cumulative_logprob),
                                   m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                   m.finished_time))
        first = state.children[0]
        plp = None
        if first.sampling_params.prompt_logprobs is not None and not sent.prompt_logprobs and (
                first.output_token_ids or first.is_finished):
            plp = [_logprob_rows(p) for p in first.prompt_logprobs]
            sent.prompt_logprobs = True
        pooled = None
        if first.pooled is not None:
            pooled = first.pooled.detach().to(torch.float32).contiguous().numpy().tobytes()
        if all(c.is_finished for c in state.children):
            del self.states[request_id]
            del self._sent[request_id]
        return P.RequestDelta(request_id, first.metrics.arrival_time, seqs, max(0, first.num_cached_tokens),
                              plp, pooled)


    def _plain_delta(self, request_id: str, req: Request, sent: _Sent) -> P.RequestDelta:
        """make_output of a one-sample request without logprobs or pooling (most requests, every step):
        the same delta, without the general path's per-sample loop and checks."""
        out = req.output_token_ids
        num, status = len(out), req.status
        finished = status.finished
        seqs = []
        if num != sent.tokens[0] or finished != sent.finished[0]:
            new = out[sent.tokens[0]:]
            sent.tokens[0] = num
            sent.finished[0] = finished
            m = req.metrics
            seqs.append(P.SeqDelta(req.index, new, status.finish_reason, req.stop_reason if finished else None, None,
                                   float(req.cumulative_logprob), m.first_scheduled_time, m.first_token_time,
                                   m.last_token_time, m.finished_time))
        if finished:
            del self.states[request_id]
            del self._sent[request_id]
        cached = req.num_cached_tokens
        return P.RequestDelta(request_id, req.metrics.arrival_time, seqs, cached if cached > 0 else 0)


class _CoreState:
    __slots__ = ("children",)

    def __init__(self, children: list[Request]) -> None:
        self.children = children


def sample_pool(engine: LLMEngine) -> tuple:
    """The dashboard's view of one moment of ``engine`` (engine thread only): (num_blocks, running,
    waiting, cached_free, num_running, num_waiting, kv_cache_usage, num_cached_free_blocks), a queue
    entry being (request id, prompt tokens, output tokens, computed tokens, preemptions, block ids)."""
    sched = engine.scheduler
    kv = engine.kv_cache_manager
    tables = kv.req_to_blocks

    def entry(r: Request) -> tuple:
        blocks = tables.get(r.request_id)
        return (r.request_id, r.num_prompt_tokens, r.num_output_tokens, r.num_computed_tokens, r.num_preemptions,
                [b.block_id for b in blocks if b is not kv.null_block] if blocks else [])

    pool = kv.block_pool
    stats = engine.get_stats()
    return (pool.num_blocks, [entry(r) for r in sched.running], [entry(r) for r in sched.waiting],
            [b.block_id for b in pool.cached_block_hash_to_block.values() if b.ref_cnt == 0],
            stats.num_running, stats.num_waiting, stats.kv_cache_usage, pool.num_cached_free_blocks)


def core_main(engine_args: Any, index: int, num_threads: int, input_addr: str, output_addr: str,
              parent_pid: int, log_level: str = "INFO", visible_devices: Optional[str] = None) -> None:
    """Entry point of a spawned engine core process (never returns: exits the process).
    ``input_addr``: the front end's PUSH socket for this core (we connect a PULL); ``output_addr``:
    its PULL socket (we connect a PUSH). ``visible_devices``: this core's GPUs (CUDA_VISIBLE_DEVICES),
    set before CUDA starts."""
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end handles Ctrl-C and tells us to stop
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    # Tensor-parallel workers of this core (spawned later) share its cores, not the machine's.
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    init_logger(log_level)
    ctx = zmq.Context(io_threads=1)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(input_addr)
    encoder, decoder = P.core_codec()
    try:
        engine = LLMEngine.from_engine_args(engine_args, log_stats=True)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which prints it
        out.send(encoder.encode(P.StartError(index, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError)
                                             else str(e), isinstance(e, (ValueError, OSError)))))
        out.close()
        ctx.term()  # (waits up to LINGER for the message to leave: os._exit would drop it)
        os._exit(1)
    engine.output_processor = DeltaCollector(engine.tokenizer, engine.pooling)
    cc = engine.config.cache_config
    out.send(encoder.encode(P.Ready(index, os.getpid(), cc.num_blocks, num_threads, cc.sliding_window)))
    EngineCore(engine, index, inp, out, encoder, decoder).run()


class EngineCore:
    """The busy loop of one core over its two sockets."""

    def __init__(self, engine: LLMEngine, index: int, inp: Any, out: Any, encoder: Any, decoder: Any) -> None:
        self.engine = engine
        self.index = index
        self.inp = inp
        self.out = out
        self.encoder = encoder
        self.decoder = decoder
        self.pool_interval = 0.0  # > 0 while a dashboard watches
        self._pool_last = 0.0
        self._pool_version = 0
        self._pool_dirty = True

    def snapshot(self) -> P.CoreSnapshot:
        e = self.engine
        s = e.get_stats()
        pool = e.kv_cache_manager.block_pool
        return P.CoreSnapshot(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_preemptions,
                              s.prefix_cache_queries, s.prefix_cache_hits, e.num_prompt_tokens_total,
                              e.num_generation_tokens_total, pool.num_usable_blocks, pool.get_num_free_blocks(),
                              pool.num_cached_free_blocks, self._spec_counters(),
                              (s.mm_cache_queries, s.mm_cache_hits))

    def _spec_counters(self) -> Optional[tuple[int, int, int, list[int]]]:
        sp = self.engine.speculator
        if sp is None:
            return None
        st = sp.stats
        return st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos)

    def _send(self, msg: Any) -> None:
        self.out.send(self.encoder.encode(msg), copy=False)

    def _apply(self, msg: Any) -> bool:
        """Apply one front-end message; False for Shutdown."""
        engine = self.engine
        if isinstance(msg, P.AddRequest):
            try:
                prompt = ({"prompt_token_ids": msg.prompt_token_ids} if msg.mm_inputs is None
                          else {"mm_inputs": msg.mm_inputs})
                engine.add_request(msg.request_id, prompt, msg.params,
                                   arrival_time=msg.arrival_time, priority=msg.priority,
                                   lora_request=msg.lora_request)
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the core
                self._send(P.Rejected(self.index, msg.request_id,
                                      str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        elif isinstance(msg, P.AbortRequests):
            self._pool_dirty = True
            live = [r for r in msg.request_ids if r in engine.output_processor.states]
            if live:
                engine.abort_request(live)  # frees their KV blocks now
        elif isinstance(msg, P.StopSequences):
            self._pool_dirty = True
            engine.scheduler.finish_requests(msg.sequence_ids, RequestStatus.FINISHED_STOPPED)
            op = engine.output_processor
            for parent in dict.fromkeys(s.split("#", 1)[0] if "#" in s else s for s in msg.sequence_ids):
                if op.is_finished(parent):
                    op.make_output(parent)  # drop its state; the front end has already finished it
        elif isinstance(msg, P.WatchPool):
            self.pool_interval = msg.interval_s
            self._pool_dirty = True
        elif isinstance(msg, P.LoRAUpdate):
            if msg.add is not None:  # checked by the front end already
                engine.checked_loras[msg.add.lora_int_id] = msg.add
            if msg.remove_id is not None:
                engine.remove_lora(msg.remove_id)
        elif isinstance(msg, P.Shutdown):
            return False
        return True

    def _drain(self, block_ms: int) -> bool:
        """Apply every queued message, first waiting up to ``block_ms`` for one; False on Shutdown."""
        inp = self.inp
        # (also with block_ms 0, between steps: a poll costs a third of the zmq.Again a recv raises)
        if not inp.poll(block_ms):
            return True
        while True:
            try:
                frame = inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            if not self._apply(self.decoder.decode(frame.buffer)):
                return False

    def _sample_pool(self, stepped: bool) -> None:
        """Ship a block-pool snapshot for the dashboard if one is due (as PoolSampler.on_step)."""
        if stepped:
            self._pool_dirty = True
        if not self.pool_interval or not self._pool_dirty:
            return
        now = time.monotonic()
        if stepped and now - self._pool_last < self.pool_interval:
            return
        self._pool_version += 1
        self._send(P.PoolSample(self.index, self._pool_version, time.time(), *sample_pool(self.engine)))
        self._pool_dirty = False
        self._pool_last = now

    def run(self) -> None:
        engine = self.engine
        last_health = time.monotonic()
        sent_idle = False
        try:
            while True:
                if not engine.has_unfinished_requests():
                    if not sent_idle:  # one snapshot after the last step shows the emptied pool
                        self._send(P.StepOutputs(self.index, [], self.snapshot()))
                        sent_idle = True
                    if self.pool_interval:
                        self._sample_pool(False)  # (once: until a message changes something)
                    if not self._drain(int(_IDLE_HEALTH_CHECK_S * 1000)):
                        break
                    if time.monotonic() - last_health >= _IDLE_HEALTH_CHECK_S:
                        last_health = time.monotonic()
                        engine.check_health()
                    continue
                if not self._drain(0):
                    break
                if not engine.has_unfinished_requests():
                    continue
                sent_idle = False
                outputs = engine.step()
                self._send(P.StepOutputs(self.index, outputs, self.snapshot()))
                if self.pool_interval:
                    self._sample_pool(True)
        except BaseException as e:  # noqa: BLE001 - report, then die loudly
            msg = f"{type(e).__name__}: {e}"
            logger.error("engine core %d failed: %s\n%s", self.index, msg, traceback.format_exc())
            try:
                self._send(P.Dead(self.index, msg))
            except Exception:  # noqa: BLE001 - the front end may be gone
                pass
            self._exit(1)
        self._exit(0)

    def _exit(self, code: int) -> None:
        try:
            self.engine.shutdown()
        finally:
            try:
                self.out.close(linger=1000)
            finally:
                os._exit(code)

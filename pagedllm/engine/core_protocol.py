"""What the API server process and an engine core process (``engine/core.py``) say to each other
over ZeroMQ: msgspec Structs in MessagePack, one message a frame (vLLM V1's ``EngineCoreRequest`` /
``EngineCoreOutputs``, our own fields).

Front -> core (a PUSH socket per core): ``AddRequest``, ``AbortRequests`` (whole requests, by the
id given to ``add_request``: their blocks are freed before the next step), ``StopSequences`` (samples
whose stop string the front end found; the core finishes them as stopped), ``WatchPool`` (ship a
block-pool snapshot at most every ``interval_s`` for the dashboard), ``LoRAUpdate`` (an adapter the
front end has checked is served from now on / one is unloaded: ``/v1/load_lora_adapter``,
``--lora-modules``; no reply: the front end answers the client), ``Shutdown``.

Core -> front (one PULL socket all cores push to): ``Ready``, ``StartError``, ``StepOutputs`` (per
step: each advanced request's new token ids, finish reasons, logprobs, timestamps, and the core's
counters for /metrics), ``Rejected`` (``add_request`` raised), ``PoolSample``, ``Dead``.

Outputs are deltas: the core never detokenizes; token ids go to the front end, which turns them
into text, matches stop strings and builds the cumulative ``RequestOutput`` its callers read.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalInputs
from pagedllm.sampling_params import SamplingParams

# One position's logprobs: (token id, logprob, rank, decoded text) of the sampled token, then the top-N.
LogprobRow = tuple[int, float, Optional[int], Optional[str]]


class AddRequest(msgspec.Struct, array_like=True, tag=0):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_request: Optional[LoRARequest] = None  # the LoRA adapter it runs with (None: the base model)
    # Its images, processed by the front end (prompt_token_ids then equals mm_inputs.prompt_token_ids)
    mm_inputs: Optional[MultiModalInputs] = None


class AbortRequests(msgspec.Struct, array_like=True, tag=1):
    request_ids: list[str]


class StopSequences(msgspec.Struct, array_like=True, tag=2):
    sequence_ids: list[str]  # child ids ("req" or "req#i" with n > 1)


class WatchPool(msgspec.Struct, array_like=True, tag=3):
    interval_s: float


class Shutdown(msgspec.Struct, array_like=True, tag=4):
    pass


class LoRAUpdate(msgspec.Struct, array_like=True, tag=5):
    """``add``: an adapter read and checked by the front end (the core records it, no re-read; the
    runner reads its weights the first step that needs them). ``remove_id``: an adapter unloaded
    (requests running with it finish with it)."""
    add: Optional[LoRARequest] = None
    remove_id: Optional[int] = None


FrontMessage = Union[AddRequest, AbortRequests, StopSequences, WatchPool, Shutdown, LoRAUpdate]


class SeqDelta(msgspec.Struct, array_like=True):
    """What one sample gained in one step."""
    index: int
    new_token_ids: list[int]
    finish_reason: Optional[str]           # "stop", "length", "abort"; None while running
    stop_reason: Union[int, str, None]
    new_logprobs: Optional[list[list[LogprobRow]]]  # one list per new token (logprobs asked)
    cumulative_logprob: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    last_token_time: Optional[float]
    finished_time: Optional[float]


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    arrival_time: float
    seqs: list[SeqDelta]                   # only the samples that changed
    num_cached_tokens: int
    prompt_logprobs: Optional[list[Optional[list[LogprobRow]]]] = None  # once, when complete
    pooled: Optional[bytes] = None         # the pooling runner's embedding, float32 bytes


class CoreSnapshot(msgspec.Struct, array_like=True):
    """The counters of ``EngineSnapshot`` (``SchedulerStats`` flattened)."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    # speculative decoding's counters (SpecDecodeStats: num_drafts, num_draft_tokens,
    # num_accepted_tokens, accepted_per_pos); None when it is off
    spec_decode: Optional[tuple[int, int, int, list[int]]] = None
    mm_cache: tuple[int, int] = (0, 0)  # encoder cache (queries, hits): images a step needed, cached ones


class Ready(msgspec.Struct, array_like=True, tag=10):
    core: int
    pid: int
    num_blocks: int
    threads: int
    sliding_window: Optional[int]  # as the core's KV-cache sizing settled it (cache_config.sliding_window)


class StartError(msgspec.Struct, array_like=True, tag=11):
    core: int
    message: str
    is_value_error: bool


class StepOutputs(msgspec.Struct, array_like=True, tag=12):
    core: int
    outputs: list[RequestDelta]
    snapshot: CoreSnapshot


class Rejected(msgspec.Struct, array_like=True, tag=13):
    core: int
    request_id: str
    message: str


class PoolSample(msgspec.Struct, array_like=True, tag=14):
    core: int
    version: int
    time: float
    num_blocks: int
    running: list[tuple[str, int, int, int, int, list[int]]]
    waiting: list[tuple[str, int, int, int, int, list[int]]]
    cached_free: list[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_cached_free_blocks: int


class Dead(msgspec.Struct, array_like=True, tag=15):
    core: int
    reason: str


CoreMessage = Union[Ready, StartError, StepOutputs, Rejected, PoolSample, Dead]


def front_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """The front end's encoder (of FrontMessage) and decoder (of CoreMessage)."""
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreMessage)


def core_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """The core's encoder (of CoreMessage) and decoder (of FrontMessage)."""
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FrontMessage)

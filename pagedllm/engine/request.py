"""State of one sequence inside the engine (one per completion: ``n`` > 1 fans out)."""
from __future__ import annotations

import enum
import time
from typing import Optional

import torch

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature, MultiModalInputs
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    # Each member also has ``finished`` (bool) and ``finish_reason`` ("stop", "length", "abort" or
    # None) as plain attributes, set below: they are read for every sequence every step, and an
    # enum property costs a descriptor call plus ``.value`` (itself a descriptor) each time.
    finished: bool
    finish_reason: Optional[str]


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}
for _status in RequestStatus:
    _status.finished = _status.value >= RequestStatus.FINISHED_STOPPED.value
    _status.finish_reason = _FINISH_REASONS.get(_status)
del _status


class Request:
    """One sequence: prompt, generated tokens, how many of them have K/V in the cache.

    ``num_computed_tokens`` counts tokens whose K/V are in the paged cache; the scheduler
    advances it, and preemption by recompute resets it to 0 (the generated tokens then
    become part of what is prefilled again).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: Optional[int], arrival_time: Optional[float] = None,
                 max_tokens: int = 16, parent_id: Optional[str] = None, index: int = 0,
                 device: str = "cpu", priority: int = 0, lora_request: Optional[LoRARequest] = None,
                 mm_inputs: Optional[MultiModalInputs] = None) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        # The sample that prefills the prompt for all ``n`` samples (itself for sample 0).
        self.parent_leader_id = request_id if index == 0 else f"{self.parent_id}#0"
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling (-1: not yet)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        # Logprobs, filled by the output processor.
        self.cumulative_logprob = 0.0
        self.logprobs: list = []
        # One entry per prompt position, the first None (no logits before it; vLLM's convention), so
        # a one-token prompt's list is [None] though no logits are ever collected for it.
        self.prompt_logprobs: list = [None] if sampling_params.prompt_logprobs is not None else []
        self.generator: Optional[torch.Generator] = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling_params.seed)
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (prefix caching)
        self.grammar = None  # structured outputs: GrammarMatcher over output_token_ids
        self.sampling_row = None  # the sampler's view of it, kept by the engine once it stops changing
        # Set by the scheduler on add_request (Scheduler._set_stop_filter): token ids that can stop it,
        # and the token count at which it is length-capped (0 until then: every token is checked).
        self.stop_ids: frozenset[int] = frozenset()
        self.length_cap = 0
        self.pooled: Optional[torch.Tensor] = None  # the pooling runner's embedding [hidden_size], float32
        self.priority = priority  # under the priority policy, lower runs first (then earlier arrival)
        self.lora_request = lora_request  # the LoRA adapter its tokens run with (None: the base model)
        # Speculative decoding: this step's proposed next tokens (engine/speculator.py), scheduled after
        # the last sampled token and verified in the same forward pass; never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        # Images (multimodal/inputs.py): each one's placeholder span in the prompt, hash and tensors, in
        # prompt order; for an M-RoPE model the prompt's positions [3, L] int64 and the delta of the
        # positions after it (None / 0: plain positions).
        self.mm_features: list[MultiModalFeature] = list(mm_inputs.features) if mm_inputs is not None else []
        self.mrope_positions: Optional[torch.Tensor] = (
            mm_inputs.mrope_positions.tensor() if mm_inputs is not None and mm_inputs.mrope_positions else None)
        self.mrope_position_delta = mm_inputs.mrope_position_delta if mm_inputs is not None else 0

    @property
    def priority_key(self) -> tuple[int, float]:
        """Order under the priority policy: (priority, arrival time), smallest first."""
        return self.priority, self.metrics.arrival_time

    def mm_block_key(self, start: int, end: int) -> bytes:
        """The identifiers of the images whose placeholder spans overlap token positions [start, end)
        (one KV block), joined: mixed into that block's prefix-cache hash so that blocks of different
        images behind the same placeholder tokens never match (b"" without images there)."""
        return b"".join(f.identifier.encode() for f in self.mm_features
                        if f.offset < end and start < f.offset + f.length)

    def mm_chunk_tokens(self, start: int, num_new: int) -> int:
        """``num_new`` cut so that the chunk [start, start + num_new) does not end inside an image's
        placeholder span: it ends before the span instead (0 when it starts inside one it cannot
        finish). An image's tokens are thus computed in one step, with its encoder output at hand."""
        end = start + num_new
        for f in self.mm_features:
            lo, hi = f.offset, f.offset + f.length
            if lo < end < hi:
                return max(0, lo - start) if start <= lo else 0
        return num_new

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")


def banned_token_ids(sp, num_out: int, eos_token_id: Optional[int]) -> Optional[list[int]]:
    """Before ``min_tokens`` outputs (``num_out`` so far), EOS and stop token ids cannot be sampled (as in
    vLLM); None once they may. Used by the engine's sampling rows and speculative verification alike."""
    if num_out >= sp.min_tokens:
        return None
    banned = list(sp.stop_token_ids)
    if not sp.ignore_eos:
        banned += list(sp.all_stop_token_ids)
        if eos_token_id is not None:
            banned.append(eos_token_id)
    return banned or None

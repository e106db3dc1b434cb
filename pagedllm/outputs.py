"""What the engine returns for a request (mirrors vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """Log-probability (natural log, of the unmodified model distribution) of one token.

    ``rank`` is 1 for the most likely token; ``decoded_token`` is its text.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One position: token id -> Logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is ``"stop"`` (EOS, a stop string or a stop token id), ``"length"``
    (max_tokens or max_model_len), ``"abort"``, or None while running; ``stop_reason`` is the
    matched stop string or stop token id (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[PositionLogprobs]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps of a request (``time.time()``, seconds)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Cumulative output of a request so far (or final when ``finished``)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)  # type: ignore[assignment]
    num_cached_tokens: int = 0
    # The pooling runner's embedding of the prompt: float32 [hidden_size], unit L2 norm (None otherwise).
    pooled: Optional["torch.Tensor"] = None


@dataclass
class EmbeddingOutput:
    """``embedding``: the prompt's embedding (hidden_size floats, unit L2 norm)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's class of that name)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> "EmbeddingRequestOutput":
        if out.pooled is None:
            raise ValueError(f"request {out.request_id} has no embedding (not run by the pooling runner)")
        return cls(out.request_id, EmbeddingOutput(out.pooled.tolist()), out.prompt_token_ids, out.finished,
                   out.num_cached_tokens)

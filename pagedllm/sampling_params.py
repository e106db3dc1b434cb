"""Sampling parameters of one request, validated at construction (names follow vLLM)."""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedllm.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
_IMMUTABLE = frozenset({int, float, bool, str, bytes, type(None)})  # shared by SamplingParams.clone
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """How to pick output tokens for one request.

    Attributes:
        n: number of independent completions returned for the prompt (>= 1).
        temperature: softmax temperature (>= 0); 0 means greedy (argmax).
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass
            reaches ``top_p`` (0 < top_p <= 1).
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's (0..1).
        seed: per-request random seed; output depends only on the seed, not on the batch.
        presence_penalty, frequency_penalty: OpenAI penalties over generated tokens (-2..2).
        repetition_penalty: CTRL-style penalty (Keskar et al., 2019) over prompt and
            generated tokens; 1.0 disables, > 1 discourages repeats.
        max_tokens: maximum number of generated tokens (>= 1); None = up to max_model_len.
        min_tokens: EOS, stop token ids and stop strings are ignored until this many tokens were generated.
        stop: strings that end generation; the stop string is not part of the output text.
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in text).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: return the sampled token's logprob plus the top-N (N = logprobs).
        prompt_logprobs: return top-N logprobs of each prompt token (plus the token itself).
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        logit_bias: token id -> value added to its logit before sampling (each in [-100, 100];
            -100 effectively bans, 100 effectively forces), as in the OpenAI API.
        allowed_token_ids: only these token ids may be sampled (vLLM).
        bad_words: words that may not be generated: a word's last token is banned when the
            output ends with its preceding tokens (vLLM; each word with and without a leading space).
        structured_outputs: the output must match a JSON schema, regex, choice or grammar
            (``StructuredOutputsParams`` or a dict of its fields).

    Raises:
        ValueError: on any out-of-range or wrongly typed value (NaN, None, a float where an integer
            is needed), with the field named in the message.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Filled by the engine from the tokenizer/generation config (not user-facing).
    all_stop_token_ids: set = field(default_factory=set, repr=False)
    bad_words_token_ids: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)  # (anything else is refused by _verify)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()
        self._verify_logits_fields()

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("min_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is None and name != "min_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise bad(name, "must be an integer")
            setattr(self, name, int(value))  # e.g. numpy integers, which torch.Generator refuses
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX - (self.n - 1):
            raise bad("seed", f"must be in [{_SEED_MIN}, {_SEED_MAX - (self.n - 1)}] (n={self.n})")
        if self.temperature < 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or 0 or -1 (disabled)")
        self.top_k = max(int(self.top_k), 0)  # -1 and 0 disable it, as in vLLM
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be positive")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers")

    def _verify_logits_fields(self) -> None:
        def is_int(t: Any) -> bool:
            return not isinstance(t, bool) and isinstance(t, numbers.Integral)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
            bias = {}
            for tok, value in self.logit_bias.items():
                try:
                    tid = int(tok)  # JSON keys are strings
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {tok!r}") from None
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100 <= value <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for token {tid}")
                bias[tid] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids \
                    or not all(is_int(t) for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = [w for w in self.bad_words if w.strip()] or None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")

    def token_ids_out_of_vocab(self, vocab_size: int) -> Optional[str]:
        """A message naming the first field with a token id outside [0, vocab_size), else None."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                return f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})"
        return None

    def logprobs_above(self, limit: int) -> Optional[str]:
        """The first of ``logprobs``, ``prompt_logprobs`` that asks for more than ``limit``, else None."""
        return next((name for name in ("logprobs", "prompt_logprobs")
                     if getattr(self, name) is not None and getattr(self, name) > limit), None)

    @property
    def has_logits_processors(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> "SamplingParams":
        """A copy sharing nothing mutable with this one (``copy.deepcopy``'s result), made field by field:
        numbers, strings and None are shared as they are, lists, sets and dicts of them copied, anything
        else deep-copied (the engine clones once per sample; deepcopy of the whole took ~40 us a request)."""
        new = object.__new__(type(self))
        fields = new.__dict__
        for name, value in vars(self).items():
            kind = type(value)
            if kind in _IMMUTABLE:
                fields[name] = value
            elif (kind is list or kind is set) and all(type(v) in _IMMUTABLE for v in value):
                fields[name] = kind(value)
            elif kind is dict and all(type(k) in _IMMUTABLE and type(v) in _IMMUTABLE for k, v in value.items()):
                fields[name] = dict(value)
            else:
                fields[name] = copy.deepcopy(value)
        return new

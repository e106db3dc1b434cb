"""Turns engine-internal sequences into ``RequestOutput``s: detokenizes new tokens, applies stop
strings, collects logprobs, and joins the ``n`` child sequences of a request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedllm.engine.detokenizer import IncrementalDetokenizer, byte_level_decoder, token_bytes
from pagedllm.engine.request import Request
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    num_detokenized: list[int] = field(default_factory=list)
    # No sample has stop strings: its text is needed only for an output, so under final outputs only
    # (OutputProcessor.process's defer) it is detokenized then, not every step.
    deferrable: bool = False
    # What the last output carried, per sample: (output tokens, finished); None before the first output
    # (read by OutputProcessor.output_due under a stream interval).
    last_output: Optional[list[tuple[int, bool]]] = None


class OutputProcessor:
    """``stream_interval`` N (vLLM's ``--stream-interval``): the engine loops ask ``output_due`` before
    making a running request's output, so a caller gets one every N tokens of a sample (plus the first
    and the finishing one) instead of one a step; detokenization and stop strings still run every step.

    Deferred detokenization (``process(..., defer=True)``: offline ``LLM.generate``, which wants final
    outputs only, one token a sample a step): a request none of whose samples has a stop string is
    not detokenized each step; ``make_output`` catches it up first, feeding its detokenizers the same
    one-token updates the steps would have (so the text is the same, character for character), and
    the first step without ``defer`` catches every such request up before its own work."""

    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.states: dict[str, RequestState] = {}
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}
        # Each token's text alone, for the detokenizers (skip_special_tokens False, True).
        self._one_token_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self._one_token_bytes: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})
        fast = getattr(tokenizer, "_tokenizer", None)
        self._byte_level = fast is not None and byte_level_decoder(fast)
        # Requests with a stop string (never deferred; ``drop`` keeps the count), and whether some step
        # since the last catch-up deferred the others.
        self.num_eager = 0
        self._lagging = False

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    children: list[Request]) -> None:
        dets = []
        for c in children:
            sp = c.sampling_params
            skip = bool(sp.skip_special_tokens)
            dets.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sp.skip_special_tokens, sp.stop,
                                               sp.include_stop_str_in_output, self._one_token_texts[skip],
                                               self._byte_level, self._one_token_bytes[skip]))
        deferrable = not any(c.sampling_params.stop for c in children)
        self.drop(request_id)  # (a reused id: the engine refuses one still running)
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, children, dets,
                                               [0] * len(children), deferrable=deferrable)
        self.num_eager += not deferrable

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s state (no output made); nothing for an unknown id."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self.num_eager -= not state.deferrable

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (detokenizer.token_bytes), cached."""
        b = self._token_bytes_cache.get(token_id)
        if b is None:
            b = self._token_bytes_cache[token_id] = token_bytes(self.tokenizer, token_id, self.token_text(token_id))
        return b

    def make_logprobs(self, lp: tuple[float, int, list[int], list[float]], token_id: int) -> dict[int, Logprob]:
        value, rank, top_ids, top_vals = lp
        d = {token_id: Logprob(value, rank, self.token_text(token_id))}
        for r, (tid, v) in enumerate(zip(top_ids, top_vals), start=1):
            if tid not in d:
                d[tid] = Logprob(v, r, self.token_text(tid))
        return d

    def process(self, updated: list[Request], defer: bool = False) -> list[str]:
        """Detokenize the new tokens of ``updated`` sequences; returns ids of sequences that
        matched a stop string (the engine finishes them). ``defer``: only final outputs are wanted
        and each sequence got at most one token this step (no speculative decoding): requests without
        stop strings are left to ``make_output`` (see the class)."""
        stopped = []
        states = self.states
        if defer:
            self._lagging = True
            if not self.num_eager:
                return stopped
        elif self._lagging:
            self._lagging = False
            for state in states.values():
                if state.deferrable:
                    self._catch_up(state)
        for req in updated:
            state = states.get(req.parent_id)
            if state is None or defer and state.deferrable:
                continue
            i = req.index
            out = req.output_token_ids
            num_out = len(out)
            new = _text_tokens(req, out[state.num_detokenized[i]:])
            state.num_detokenized[i] = num_out
            if not new:
                continue
            # min_tokens holds back stop strings too: only text ending past it can match one.
            matched = state.detokenizers[i].update(new, num_out > req.sampling_params.min_tokens)
            if matched is not None:
                req.stop_reason = matched
                if not req.status.finished:
                    stopped.append(req.request_id)
        return stopped

    def _catch_up(self, state: RequestState) -> None:
        """Detokenize a deferred request's tokens that ``process`` skipped, one update a token as the
        steps would have made them (each of those steps gave a sample one token)."""
        for req, det in zip(state.children, state.detokenizers):
            i = req.index
            out = req.output_token_ids
            new = _text_tokens(req, out[state.num_detokenized[i]:])
            state.num_detokenized[i] = len(out)
            det.update_each(new)

    def output_due(self, request_id: str) -> bool:
        """Whether ``request_id``'s next output should be made now under ``stream_interval`` N (vLLM's
        ``RequestState.make_request_output`` rule): always with N = 1; else when it has had no output
        yet (its first token: time to first token is kept), when a sample finished since its last
        output, or when a sample has N or more tokens beyond what its last output carried. An unknown
        id is due (``make_output`` answers None for it)."""
        n = self.stream_interval
        if n <= 1:
            return True
        state = self.states.get(request_id)
        if state is None or state.last_output is None:
            return True
        for req, (num, finished) in zip(state.children, state.last_output):
            if req.status.finished != finished or len(req.output_token_ids) - num >= n:
                return True
        return False

    def is_finished(self, request_id: str) -> bool:
        state = self.states.get(request_id)
        return state is not None and all(c.is_finished for c in state.children)

    def make_output(self, request_id: str) -> Optional[RequestOutput]:
        state = self.states.get(request_id)
        if state is None:
            return None
        if state.deferrable and self._lagging:
            self._catch_up(state)
        children = state.children
        outs = []
        finished = True
        # (Positional arguments: keywords cost twice as much in a dataclass's __init__, per sample.)
        for req, det in zip(children, state.detokenizers):
            done = req.status.finished
            finished = finished and done
            if req.sampling_params.logprobs is None:
                outs.append(CompletionOutput(req.index, det.visible_text(done), list(req.output_token_ids), None, None,
                                             req.status.finish_reason if done else None,
                                             req.stop_reason if done else None))
            else:
                outs.append(CompletionOutput(req.index, det.visible_text(done), list(req.output_token_ids),
                                             req.cumulative_logprob, list(req.logprobs),
                                             req.status.finish_reason if done else None,
                                             req.stop_reason if done else None))
        first = children[0]
        plp = first.prompt_logprobs if first.sampling_params.prompt_logprobs is not None else None
        output = RequestOutput(request_id, state.prompt, state.prompt_token_ids, list(plp) if plp is not None else None,
                               outs, finished, _metrics(children, finished), max(0, first.num_cached_tokens),
                               first.pooled)
        if finished:
            self.drop(request_id)
        elif self.stream_interval > 1:
            state.last_output = [(len(c.token_ids), c.finish_reason is not None) for c in outs]
        return output


def _metrics(children: list[Request], finished: bool) -> RequestMetrics:
    """A request's times from its samples': the first arrival's, the earliest first scheduling and first
    token, the latest last token and (once all are) finished time; an unset (None or 0) time is left out."""
    if len(children) == 1:  # (the same values, without the min/max over generators)
        t = children[0].metrics
        return RequestMetrics(t.arrival_time, t.first_scheduled_time or None, t.first_token_time or None,
                              t.last_token_time or None, (t.finished_time or 0.0) if finished else None)
    times = [c.metrics for c in children]
    return RequestMetrics(
        times[0].arrival_time,
        min((t.first_scheduled_time for t in times if t.first_scheduled_time), default=None),
        min((t.first_token_time for t in times if t.first_token_time), default=None),
        max((t.last_token_time for t in times if t.last_token_time), default=None),
        max(t.finished_time or 0.0 for t in times) if finished else None)


def _text_tokens(req: Request, new: list[int]) -> list[int]:
    """``new``, the sequence's tokens not detokenized yet, less a finishing EOS or stop token id (not
    part of the text; it can only be the last)."""
    stop_reason = req.stop_reason
    if new and (req.status.finish_reason == "stop" and stop_reason is None or isinstance(stop_reason, int)):
        return new[:-1]
    return new

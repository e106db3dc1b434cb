"""Structured outputs: grammar compilation (llguidance) and per-request token masks for the sampler.

``StructuredOutputsParams`` says what the output must match (JSON schema, regex, choice, grammar);
``GrammarCompiler`` turns it into a grammar once (cached) and makes one ``GrammarMatcher`` per
sequence; the sampler applies the matchers' batched bitmask and the engine advances each matcher
with the token it sampled. Names follow vLLM (``vllm/sampling_params.py``, ``vllm/v1/structured_output``).
"""
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]

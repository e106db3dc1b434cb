"""Grammar compilation with llguidance (https://github.com/guidance-ai/llguidance): one tokenizer
table per engine, compiled grammars cached by constraint, one matcher per sequence.

Why llguidance: a 3 MB wheel without dependencies (xgrammar 0.2.8 pulls triton and tvm-ffi), JSON
schema, regex, Lark and GBNF in one library, and a token mask in ~0.1 ms per sequence (measured on
SmolLM2's 49k vocabulary, 32 sequences per step). outlines-core covers regex and non-recursive schemas
only and needs a per-schema index build.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional

import llguidance

from pagedllm.structured_output.matcher import GrammarMatcher
from pagedllm.structured_output.params import StructuredOutputsParams

_CACHE_SIZE = 256
_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (llguidance's Rust regex syntax): meta characters
    escaped, other non-printable characters as ``\\x{...}``."""
    return "".join("\\" + c if c in _REGEX_META else c if c.isprintable() else f"\\x{{{ord(c):x}}}" for c in text)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into llguidance grammars for one tokenizer.

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's length).
    Thread-safe: the server compiles (to validate) while the engine thread makes matchers.
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._ll_tokenizer = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:  # ~1 s for a 50k vocabulary: built on first use only
                import llguidance.hf  # lazily: it imports transformers, ~1 s (not at the CLI's start)

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``params``, validated. Raises ValueError saying why a schema,
        regex or grammar is refused."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._to_grammar(params)
        err = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if err:
            raise ValueError(f"invalid structured output {params.kind}: {err.strip()}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def _to_grammar(params: StructuredOutputsParams) -> str:
        M = llguidance.LLMatcher
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.effective_json_schema()
            # Whitespace between JSON tokens is bounded: unbounded, a weak model can emit blanks
            # until max_tokens (a known failure of flexible-whitespace grammars); 16 characters
            # still allow pretty-printing three or four levels deep.
            options: dict = {"whitespace_flexible": False} if params.disable_any_whitespace else \
                {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern or _WHITESPACE}
            try:
                return M.grammar_from_json_schema(json.dumps(schema), overrides=options)
            except ValueError as e:
                raise ValueError(f"invalid structured output json schema: {e}") from None
        if kind == "regex":
            return M.grammar_from_regex(params.regex)
        if kind == "choice":
            # One regex lexeme, not a Lark rule of string alternatives: llguidance's Earley parser
            # refuses a row of more than 2,000 items at the first token (a rule of 2,000 choices),
            # while its lexer takes any number of alternatives.
            return M.grammar_from_regex("(?:" + "|".join(_regex_literal(c) for c in params.choice) + ")")
        try:
            return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"invalid structured output grammar: {e}") from None

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence (at the start of its output)."""
        return GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, self.compile(params), log_level=0),
                              self.vocab_size, self.ll_tokenizer.eos_token)


def make_compiler(tokenizer, vocab_size: int) -> Optional[GrammarCompiler]:
    """A compiler, or None when the tokenizer is not a fast (Rust) Hugging Face tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    return GrammarCompiler(tokenizer, vocab_size)

"""Incremental detokenization and stop-string matching for one sequence.

Text is produced by decoding a short window of tokens twice (with and without the newest
tokens) and emitting the difference, as Hugging Face TGI and vLLM do; the difference is held
back while it ends in an incomplete UTF-8 character (U+FFFD), so no half character is emitted.
"""
from __future__ import annotations

from typing import Optional

# Prompt tokens decoded as left context so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        # The Rust tokenizer directly (5x less overhead per call) when transformers adds nothing.
        fast = getattr(tokenizer, "_tokenizer", None)
        self._fast = fast if fast is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> Optional[str]:
        """Add tokens; returns the stop string matched (the text is then cut before it), else None.
        With ``check_stop`` False (still under ``min_tokens``) no stop string is matched; later
        checks start at the text added from then on (as vLLM's detokenizer does)."""
        self.ids.extend(new_token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.output_text += delta
        if not self.stop or not check_stop:
            return None
        search_from = max(0, len(self.output_text) - len(delta) - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            idx = self.output_text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s) if self.include_stop else idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, the last ``max_stop_len - 1`` characters are held
        back because they might be the start of a stop string."""
        if finished or not self.stop or self.include_stop or self.max_stop_len <= 1:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - (self.max_stop_len - 1))]

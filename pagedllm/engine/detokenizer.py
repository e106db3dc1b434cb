"""Incremental detokenization and stop-string matching for one sequence.

Text is produced by decoding a short window of tokens twice (with and without the newest
tokens) and emitting the difference, as Hugging Face TGI and vLLM do; the difference is held
back while it ends in an incomplete UTF-8 character (U+FFFD), so no half character is emitted.

For a tokenizer whose decoder is byte-level BPE's (GPT-2, SmolLM2, Qwen2, Llama 3) the usual step
needs no decode at all (``byte_level_decoder``): when the window's text does not end inside a
character, the difference is the new token's own text (looked up), the same text by the decoder's
definition; only windows that end inside a character are decoded.
"""
from __future__ import annotations

import json
from typing import Optional

# Prompt tokens decoded as left context so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """``one_token_texts``: a dict shared by the detokenizers of one tokenizer (the output
    processor's), token id -> its text decoded alone with this ``skip_special_tokens``: with one
    token a step the window decoded first is the previous step's one new token, so it is looked
    up instead (half the decode calls; the same text, decoding is a function of the ids).
    ``byte_level``: whether the tokenizer decodes as byte-level BPE (``byte_level_decoder``; None: find
    out here), which makes a one-token step a lookup of the new token's text (see ``_advance``).
    Test: tests/test_detokenize_byte_level.py (every step's state equal to decoding both windows)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool, one_token_texts: Optional[dict[int, str]] = None,
                 byte_level: Optional[bool] = None) -> None:
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
        self._one_token_texts = one_token_texts if one_token_texts is not None else {}
        # The text of ids[prefix_offset:read_offset] decoded alone, once known (None: not yet).
        self._prefix_text: Optional[str] = None
        # The one-token step without a decode (_advance): byte_level_decoder(the Rust tokenizer), or what the
        # caller found it to be (the output processor asks once, not per request; False: always the windows).
        if byte_level is None:
            byte_level = self._fast is not None and byte_level_decoder(self._fast)
        self.byte_level = byte_level and self._fast is not None

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> Optional[str]:
        """Add tokens; returns the stop string matched (the text is then cut before it), else None.
        With ``check_stop`` False (still under ``min_tokens``) no stop string is matched; later
        checks start at the text added from then on (as vLLM's detokenizer does)."""
        self.ids.extend(new_token_ids)
        delta = self._advance()
        if delta is None or not self.stop or not check_stop:
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

    def update_each(self, token_ids: list[int]) -> None:
        """``update([t])`` for each token in turn (the same text), for a sequence without stop strings
        whose one-token updates were put off (OutputProcessor's deferred detokenization)."""
        assert not self.stop, "stop strings are matched step by step: update() each step"
        ids = self.ids
        append, advance = ids.append, self._advance
        if not self.byte_level:
            for t in token_ids:
                append(t)
                advance()
            return
        # _advance's byte-level one-token step, inlined (a request's catch-up runs it for every token):
        # while ``steady`` no token is pending and the window's text (``prefix``) is known and does not end
        # in U+FFFD, so a step is a lookup; the new text is collected in ``parts``. Other steps: _advance.
        texts, decode, skip = self._one_token_texts, self._fast.decode, self.skip_special_tokens
        parts: list[str] = []
        po, ro, prefix = self.prefix_offset, self.read_offset, self._prefix_text
        steady = ro == len(ids) and prefix is not None and prefix[-1:] != "\ufffd"
        for t in token_ids:
            append(t)
            if steady:
                text = texts.get(t)
                if text is None:
                    text = texts[t] = decode([t], skip_special_tokens=skip)
                if text and text[-1] != "\ufffd":
                    parts.append(text)
                    po, ro, prefix = ro, ro + 1, text
                else:  # held back: the next step has two new tokens
                    steady = False
                continue
            self.output_text += "".join(parts)
            parts.clear()
            self.prefix_offset, self.read_offset, self._prefix_text = po, ro, prefix
            advance()
            po, ro, prefix = self.prefix_offset, self.read_offset, self._prefix_text
            steady = ro == len(ids) and prefix is not None and prefix[-1:] != "\ufffd"
        self.output_text += "".join(parts)
        self.prefix_offset, self.read_offset, self._prefix_text = po, ro, prefix

    def _advance(self) -> Optional[str]:
        """Decode the tokens added to ``ids`` since the last text; returns the new text (also added to
        ``output_text``), or None while it would end in an incomplete character."""
        ids = self.ids
        po, ro = self.prefix_offset, self.read_offset
        fast = self._fast
        if fast is None:
            prefix = self._decode(ids[po:ro])
            full = self._decode(ids[po:])
        else:
            # _decode, inlined: this runs for every sequence every step. The window's text is kept while
            # tokens are held back (the same ids decode to the same text), and looked up for one token.
            skip = self.skip_special_tokens
            prefix = self._prefix_text
            if prefix is None:
                if ro - po == 1:
                    prefix = self._one_token_texts.get(ids[po])
                    if prefix is None:
                        prefix = self._one_token_texts[ids[po]] = fast.decode(ids[po:ro], skip_special_tokens=skip)
                else:
                    prefix = fast.decode(ids[po:ro], skip_special_tokens=skip)
                self._prefix_text = prefix
            if self.byte_level and prefix[-1:] != "\ufffd":
                # Byte-level (byte_level_decoder): decoding is lossy UTF-8 of the tokens' bytes joined. A
                # window whose text does not end in U+FFFD ends on a whole character (or has no bytes), so
                # decoding starts afresh at the new tokens' bytes: full = prefix + new, the difference is
                # the new tokens' text alone (one token's: looked up), and that is the next window's text.
                if len(ids) == ro + 1:
                    new = self._one_token_texts.get(ids[ro])
                    if new is None:
                        new = self._one_token_texts[ids[ro]] = fast.decode(ids[ro:], skip_special_tokens=skip)
                else:
                    new = fast.decode(ids[ro:], skip_special_tokens=skip)
                if not new or new[-1] == "\ufffd":
                    return None
                self.prefix_offset, self.read_offset, self._prefix_text = ro, len(ids), new
                self.output_text += new
                return new
            full = fast.decode(ids[po:], skip_special_tokens=skip)
        # The next window's text is decoded when first needed (never kept without ``fast``).
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset, self._prefix_text = ro, len(ids), None
        self.output_text += delta
        return delta

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, the last ``max_stop_len - 1`` characters are held
        back because they might be the start of a stop string."""
        if finished or not self.stop or self.include_stop or self.max_stop_len <= 1:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - (self.max_stop_len - 1))]


def byte_level_decoder(fast) -> bool:
    """Whether ``fast`` (a ``tokenizers.Tokenizer``) decodes as byte-level BPE: its decoder, as the Rust
    backend serializes it, is exactly ``ByteLevel`` (not a sequence, not a Python-defined one). Then
    (tokenizers' ``Tokenizer::decode`` and ``ByteLevel::decode_chain``) decoding ids is: each id's token
    (an added token's content, or the model's vocabulary entry), special ones dropped under
    ``skip_special_tokens``; each token's bytes (through the byte alphabet, or its own UTF-8 when a
    character is outside it), each depending on that token only; all joined and decoded as UTF-8 with
    U+FFFD for invalid sequences. The normalizer, pre-tokenizer and post-processor take no part."""
    try:
        return json.loads(fast.decoder.__getstate__())["type"] == "ByteLevel"
    except Exception:  # noqa: BLE001 - no decoder (None), or one the backend cannot serialize (custom)
        return False


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``: printable
    Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards), inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The bytes of one token (OpenAI's logprob ``bytes``), given its decoded ``text``: the text's
    UTF-8, except for a token that holds part of a character (its text decodes to U+FFFD), whose
    own bytes come from its vocabulary entry: a SentencePiece byte-fallback piece ``<0xNN>``, or
    byte-level BPE's stand-ins (an emoji split over three GPT-2-style tokens gives, say, ``ðŁ``,
    ``Į``, ``¾``: bytes F0 9F, 8C, BE). Without either, the text's UTF-8 (EF BF BD)."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    try:
        piece = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view
        piece = None
    if isinstance(piece, str) and piece:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode("utf-8")

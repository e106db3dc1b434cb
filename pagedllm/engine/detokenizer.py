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
from operator import itemgetter
from typing import Optional

# Prompt tokens decoded as left context so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """``one_token_texts``: a dict shared by the detokenizers of one tokenizer (the output
    processor's), token id -> its text decoded alone with this ``skip_special_tokens``: with one
    token a step the window decoded first is the previous step's one new token, so it is looked
    up instead (half the decode calls; the same text, decoding is a function of the ids).
    ``byte_level``: whether the tokenizer decodes as byte-level BPE (``byte_level_decoder``; None: find
    out here), which makes a one-token step a lookup of the new token's text (see ``_advance``) and
    ``update_each`` one UTF-8 decode of the tokens' bytes (``_catch_up_bytes``). ``one_token_bytes``: a
    dict shared like ``one_token_texts`` (same ``skip_special_tokens``), token id -> its bytes.
    Test: tests/test_detokenize_byte_level.py (every step's state equal to decoding both windows)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool, one_token_texts: Optional[dict[int, str]] = None,
                 byte_level: Optional[bool] = None, one_token_bytes: Optional[dict[int, bytes]] = None) -> None:
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
        # Token id -> its bytes (_joined_bytes), for the byte-level catch-up; shared like one_token_texts.
        self._one_token_bytes = one_token_bytes if one_token_bytes is not None else {}
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
        whose one-token updates were put off (OutputProcessor's deferred detokenization). Byte-level
        (``byte_level``): once the window's text does not end in U+FFFD, all of them at once
        (``_catch_up_bytes``)."""
        assert not self.stop, "stop strings are matched step by step: update() each step"
        ids = self.ids
        append, advance = ids.append, self._advance
        i, n = 0, len(token_ids)
        if self.byte_level:
            # One-token steps while the window's text ends in U+FFFD (a prompt ending inside a character):
            # those steps take the windows' difference (_advance's last part), not the byte-level step.
            while i < n and self._window_ends_inside_character():
                append(token_ids[i])
                advance()
                i += 1
            if i < n:
                first = len(ids)
                ids.extend(token_ids[i:] if i else token_ids)
                if self._catch_up_bytes(first):
                    return
                del ids[first:]  # a token whose bytes cannot be established: the steps below
        for t in token_ids[i:]:
            append(t)
            advance()

    def _catch_up_bytes(self, first: int) -> bool:
        """The byte-level one-token steps (``_advance``) of the tokens ``ids[first:]``, all at once: the
        text they add and the state they leave. False (nothing changed) where a token's bytes are not
        known (``byte_level_token_bytes``). The window's text must not end in U+FFFD.

        Why it is the steps' text: a byte-level decode is lossy UTF-8 (U+FFFD for each maximal invalid
        subpart) of the tokens' bytes joined. A step emits its pending tokens' text when that text is
        neither empty nor ends in U+FFFD, i.e. they end on a whole character; decoding then starts afresh,
        so the texts the steps emit, joined, are one decode of all the bytes up to the last step that
        emitted. A token whose own text is non-empty and ends in a character other than U+FFFD always
        emits (that character starts with a byte no pending sequence can take, so it decodes the same
        after any pending bytes); a token without bytes never does; a token whose own text ends in U+FFFD
        emits only if the pending bytes before it complete a character with it (decoded here). So the
        steps after the second-to-last always-emitting token decide where the last emission is; those
        before it only add text. Python's ``bytes.decode("utf-8", "replace")`` substitutes maximal
        subparts as Rust's ``String::from_utf8_lossy`` does (tests/test_detokenize_byte_level.py)."""
        ids = self.ids
        texts, token_text = self._one_token_texts, self._token_text
        n = len(ids)
        # The last two tokens (from ``first``) whose text ends in a whole character: k2 (-1: none).
        k1 = k2 = -1
        k = n - 1
        while k >= first:
            text = token_text(ids[k])
            if text and text[-1] != "\ufffd":
                if k1 >= 0:
                    k2 = k
                    break
                k1 = k
            k -= 1
        # The steps after k2 (all of them without one): start, end of the last emitting step's tokens.
        ro = self.read_offset
        r = k2 + 1 if k2 >= 0 else ro  # the first pending token (the steps emit at k2)
        start = end = -1
        for k in range(k2 + 1 if k2 >= 0 else first, n):
            text = token_text(ids[k])
            if not text:
                continue
            if text[-1] != "\ufffd":
                start, end, r = r, k + 1, k + 1
            elif r < k:  # pending bytes before a token ending inside a character: they may complete one
                joined = self._joined_bytes(r, k + 1)
                if joined is None:
                    return False
                if joined.decode("utf-8", "replace")[-1] != "\ufffd":
                    start, end, r = r, k + 1, k + 1
        if end < 0:  # every step held its tokens back
            return True
        joined = self._joined_bytes(ro, end)
        if joined is None:
            return False
        self.output_text += joined.decode("utf-8", "replace")
        # The last emitting step's tokens are the window; its text is looked up for one token, else
        # decoded when first needed (_window_text).
        self.prefix_offset, self.read_offset = start, end
        self._prefix_text = texts[ids[start]] if end - start == 1 else None
        return True

    def _joined_bytes(self, start: int, end: int) -> Optional[bytes]:
        """The bytes of ``ids[start:end]`` joined (one token's: the shared ``_one_token_bytes``, learnt on
        first use by ``byte_level_token_bytes``); None if a token's cannot be established."""
        tb, span = self._one_token_bytes, self.ids[start:end]
        try:
            return b"".join(itemgetter(*span)(tb)) if len(span) > 1 else tb[span[0]]
        except KeyError:
            pass
        for t in span:
            if t in tb:
                continue
            b = byte_level_token_bytes(self._fast, t, self._token_text(t))
            if b is None:
                return None
            tb[t] = b
        return b"".join([tb[t] for t in span])

    def _window_ends_inside_character(self) -> bool:
        """Whether the window's text ends in U+FFFD. Without decoding it where its last token's own text
        ends in a whole character other than U+FFFD: the window's text then ends in that character too
        (as in ``_catch_up_bytes``: no pending bytes can take its first byte); byte-level only."""
        prefix = self._prefix_text
        if prefix is None and self.read_offset > self.prefix_offset:
            last = self._one_token_texts.get(self.ids[self.read_offset - 1])
            if last and last[-1] != "\ufffd":
                return False
        return self._window_text()[-1:] == "\ufffd"

    def _token_text(self, token_id: int) -> str:
        """The text of ``token_id`` decoded alone (looked up in the shared ``one_token_texts``; decoded and
        kept there on first use). Needs the Rust tokenizer (``_fast``)."""
        text = self._one_token_texts.get(token_id)
        if text is None:
            text = self._one_token_texts[token_id] = self._fast.decode([token_id],
                                                                        skip_special_tokens=self.skip_special_tokens)
        return text

    def _window_text(self) -> str:
        """The text of the window ``ids[prefix_offset:read_offset]`` (kept in ``_prefix_text`` once decoded):
        one token's looked up; byte-level, its tokens' bytes decoded (``_catch_up_bytes``: the same text)."""
        prefix = self._prefix_text
        if prefix is None:
            ids, po, ro = self.ids, self.prefix_offset, self.read_offset
            skip = self.skip_special_tokens
            if self._fast is None:
                return self._decode(ids[po:ro])
            if ro - po == 1:
                prefix = self._token_text(ids[po])
            else:
                joined = self._joined_bytes(po, ro) if self.byte_level and ro > po else None
                if joined is not None:
                    prefix = joined.decode("utf-8", "replace")
                else:
                    prefix = self._fast.decode(ids[po:ro], skip_special_tokens=skip)
            self._prefix_text = prefix
        return prefix

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
                prefix = self._window_text()
            if self.byte_level and prefix[-1:] != "\ufffd":
                # Byte-level (byte_level_decoder): decoding is lossy UTF-8 of the tokens' bytes joined. A
                # window whose text does not end in U+FFFD ends on a whole character (or has no bytes), so
                # decoding starts afresh at the new tokens' bytes: full = prefix + new, the difference is
                # the new tokens' text alone (one token's: looked up), and that is the next window's text.
                if len(ids) == ro + 1:
                    new = self._token_text(ids[ro])
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


def _byte_level_piece_bytes(piece: str) -> Optional[bytes]:
    """The bytes a vocabulary entry of byte stand-ins (``_BYTE_LEVEL``) stands for; None if one of its
    characters is not a stand-in."""
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


def byte_level_token_bytes(fast, token_id: int, text: str) -> Optional[bytes]:
    """The bytes a byte-level decoder (``byte_level_decoder``) makes of the one token ``token_id`` of
    ``fast`` (a ``tokenizers.Tokenizer``), given ``text``, its decode alone: none for an empty text (a
    skipped special token); the text's UTF-8 when it has no U+FFFD (lossy UTF-8 that replaced nothing);
    else, as the decoder does, its entry's stand-ins' bytes or, with a character outside them, the
    entry's UTF-8. None where the entry is unknown or its bytes do not decode to ``text``."""
    if not text:
        return b""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = fast.id_to_token(token_id)
    if not isinstance(piece, str):
        return None
    b = _byte_level_piece_bytes(piece)
    if b is None:
        b = piece.encode("utf-8")
    return b if b.decode("utf-8", "replace") == text else None


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
        b = _byte_level_piece_bytes(piece)
        if b is not None:
            return b
    return text.encode("utf-8")

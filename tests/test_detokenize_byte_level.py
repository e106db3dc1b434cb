"""The detokenizer's byte-level step (IncrementalDetokenizer._advance / update_each with ``byte_level``):
for a byte-level BPE tokenizer a one-token step takes the new token's own text instead of decoding
the window. Its text must be the windows' text exactly: random streams of ids (multi-byte characters
split over tokens, lone bytes, special tokens with skip_special_tokens on and off, added tokens whose
text is outside the byte alphabet, stop strings, several tokens at once) through detokenizers with and
without it, step for step, and against one decode of the whole stream."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import build_tokenizer
from pagedllm.engine.detokenizer import _BYTE_LEVEL, IncrementalDetokenizer, byte_level_decoder

TEXT = "caf\u00e9 \u65e5\u672c\U0001f600 na\u00efve, the end. \u00fcber \u20ac5"
_CHAR = {b: c for c, b in _BYTE_LEVEL.items()}
# Not special. Whole characters outside the byte alphabet (their UTF-8 is their bytes), and tokens of byte
# stand-ins holding parts of characters: the first two bytes of U+65E5, its last + "a", a lone continuation.
PARTS = ["".join(_CHAR[b] for b in part) for part in (b"\xe6\x97", b"\xa5a", b"\x80", b"\xe2\x82\xac!")]
ADDED = ["\u65e5\u672c\u8a9e", " hello world", "\u00fc", "<tag>", *PARTS]
SPECIAL = ["<|tool|>"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = build_tokenizer(str(tmp_path_factory.mktemp("bytelevel")))
    tok.add_tokens(ADDED)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tok


class _Counting:
    """The Rust tokenizer, counting decode calls. Given to the detokenizer as its tokenizer (it has no
    ``_tokenizer``), it makes the reference: both windows decoded every step, no cache, no byte-level step."""

    def __init__(self, fast) -> None:
        self.fast, self.calls = fast, 0

    def decode(self, ids, skip_special_tokens):
        self.calls += 1
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id):
        return self.fast.id_to_token(token_id)


def _detokenizers(tok, prompt, skip, stop, shared):
    """Byte-level (sharing ``shared``), windows with the caches, the reference; each counting decodes."""
    a = IncrementalDetokenizer(tok, prompt, skip, stop, False, shared)
    b = IncrementalDetokenizer(tok, prompt, skip, stop, False, {}, byte_level=False)
    ref = IncrementalDetokenizer(_Counting(tok._tokenizer), prompt, skip, stop, False)
    assert a.byte_level and not b.byte_level and not ref.byte_level and ref._fast is None
    a._fast, b._fast = _Counting(a._fast), _Counting(b._fast)
    return a, b, ref


def _state(det) -> tuple:
    return det.output_text, det.prefix_offset, det.read_offset, det.ids


def _streams(tok, n: int, seed: int):
    rng = random.Random(seed)
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    vocab = len(tok)
    extra = tok.convert_tokens_to_ids(ADDED + SPECIAL) + [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]
    clean = tok.encode(" the end of it", add_special_tokens=False)
    # First, a window of one token ending in part of a character, which the next token completes.
    lead, rest, cont, euro = tok.convert_tokens_to_ids(PARTS)
    yield rng, [lead], [rest, cont, rest, lead, rest, euro], False
    yield rng, [euro, lead], [rest, lead, cont, euro], False
    for i in range(n):
        pick = lambda: (rng.choice(text_ids) if (u := rng.random()) < 0.5 else  # noqa: E731
                        rng.choice(extra) if u < 0.75 else rng.randrange(vocab))
        ids = [pick() for _ in range(rng.randrange(1, 48))]
        # Prompts of whole characters (so one decode of the stream is the check), or any ids (one token
        # often: the first window is then one token, which may hold part of a character).
        prompt = clean[: rng.randrange(1, len(clean) + 1)] if i % 2 else [pick() for _ in range(rng.choice([1, 1, 4]))]
        yield rng, prompt, ids, bool(i % 2)


def test_byte_level_decoder(tok):
    assert byte_level_decoder(tok._tokenizer)
    seq = Tokenizer(models.BPE())
    seq.decoder = decoders.Sequence([decoders.ByteLevel()])
    meta = Tokenizer(models.BPE())
    meta.decoder = decoders.Metaspace()
    assert not byte_level_decoder(seq) and not byte_level_decoder(meta)
    assert not byte_level_decoder(Tokenizer(models.BPE()))  # no decoder
    plain = PreTrainedTokenizerFast(tokenizer_object=meta)
    assert not IncrementalDetokenizer(plain, [1], True, [], False).byte_level


@pytest.mark.parametrize("skip_special", [True, False])
def test_byte_level_step_gives_the_windows_text(tok, skip_special):
    shared: dict[int, str] = {}
    calls = [0, 0]
    for rng, prompt, ids, clean_prompt in _streams(tok, 300, seed=int(skip_special)):
        stop = [["the", "\u00e9"], ["\u672c"], ["d. "]][rng.randrange(3)] if rng.random() < 0.3 else []
        a, b, ref = _detokenizers(tok, prompt, skip_special, stop, shared)
        i = 0
        while i < len(ids):
            k = 1 if rng.random() < 0.85 else rng.randrange(2, 4)
            ra, rb, rr = a.update(ids[i:i + k]), b.update(ids[i:i + k]), ref.update(ids[i:i + k])
            assert ra == rb == rr and _state(a) == _state(b) == _state(ref)
            if ra is not None:
                break
            i += k
        calls = [calls[0] + a._fast.calls, calls[1] + ref.tokenizer.calls]
        if not stop and clean_prompt:
            # One decode of prompt + stream: the text after the prompt's, less a held-back partial character.
            full = tok._tokenizer.decode(prompt + ids, skip_special_tokens=skip_special)
            full = full[len(tok._tokenizer.decode(prompt, skip_special_tokens=skip_special)):]
            assert full == a.output_text or full.startswith(a.output_text) and full.endswith("\ufffd")
    assert calls[0] < calls[1] / 3  # the window decodes this saves (random streams: many partial characters)
    # ASCII tokens whose texts are known (the second time): after the first step (the prompt's window),
    # lookups only.
    ids = tok.encode(" the end. of it, the user", add_special_tokens=False)
    for _ in range(2):
        a = _detokenizers(tok, ids[:2], skip_special, [], shared)[0]
        a.update(ids[2:3])
        a._fast.calls = 0
        for t in ids[3:]:
            a.update([t])
        a.update_each(ids[3:])
    assert a._fast.calls == 0 and a.output_text == tok.decode(ids[2:]) + tok.decode(ids[3:])


class _WrongVocabulary:
    """The Rust tokenizer with a wrong vocabulary view (every entry "!"): the bytes of a token holding
    part of a character are then not confirmed by its text, so the catch-up takes one-token steps for
    the tokens that need them (and a wrong byte would show in the text)."""

    def __init__(self, fast) -> None:
        self.fast = fast

    def decode(self, ids, skip_special_tokens):
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id):
        return "!"


def _window_ok(det, skip: bool) -> bool:
    """The kept window text (if any) is the Rust decode of the window."""
    text = det._prefix_text
    return text is None or text == det.tokenizer._tokenizer.decode(det.ids[det.prefix_offset:det.read_offset],
                                                                   skip_special_tokens=skip)


@pytest.mark.parametrize("skip_special", [True, False])
def test_update_each_equals_one_token_updates(tok, skip_special):
    """update_each (deferred detokenization's catch-up: the tokens' bytes decoded at once once the
    window's text ends on a whole character) equals update([t]) token by token, split at up to three
    points (tokens held back between calls); with caches shared over streams or not, and without the
    bytes of partial characters (one-token steps for them)."""
    # Shared: every token's text known from the start (a long-running engine's), so the window checks
    # read the prompt's last token's text; not shared: nothing known yet.
    texts = {t: tok._tokenizer.decode([t], skip_special_tokens=skip_special) for t in range(len(tok))}
    tbytes: dict[int, bytes] = {}
    calls = [0, 0]
    for n, (rng, prompt, ids, _) in enumerate(_streams(tok, 300, seed=2 + int(skip_special))):
        shared = (texts, tbytes) if n % 2 else ({}, {})
        a = IncrementalDetokenizer(tok, prompt, skip_special, [], False, shared[0], one_token_bytes=shared[1])
        blind = IncrementalDetokenizer(tok, prompt, skip_special, [], False)
        blind._fast = _WrongVocabulary(blind._fast)
        _, b, ref = _detokenizers(tok, prompt, skip_special, [], {})
        a._fast = _Counting(a._fast)
        cuts = sorted(rng.randrange(len(ids) + 1) for _ in range(rng.randrange(4)))
        for lo, hi in zip([0, *cuts], [*cuts, len(ids)]):
            a.update_each(ids[lo:hi])
            blind.update_each(ids[lo:hi])
            assert _window_ok(a, skip_special) and _window_ok(blind, skip_special)
        b.update_each(ids)
        for t in ids:
            ref.update([t])
        assert _state(a) == _state(b) == _state(blind) == _state(ref)
        calls = [calls[0] + a._fast.calls, calls[1] + ref.tokenizer.calls]
    assert calls[0] < calls[1] / 3  # the catch-up decodes little with Rust (texts learnt once per stream)


def test_python_lossy_utf8_is_rusts(tok):
    """``bytes.decode("utf-8", "replace")`` (the catch-up's decode) gives the byte-level decoder's text
    (Rust's ``String::from_utf8_lossy``) for every sequence of up to 3 bytes from the boundaries of the
    UTF-8 byte classes (ASCII, continuations, overlong and surrogate leads, 4-byte leads, invalid) and
    random longer ones: one U+FFFD per maximal invalid subpart in both."""
    byte_id = {b: tok.convert_tokens_to_ids(_CHAR[b]) for b in range(256)}
    edges = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC,
             0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
    seqs = [[a] for a in edges] + [[a, b] for a in edges for b in edges]
    seqs += [[a, b, c] for a in edges[3:] for b in edges[3:10] for c in edges[:10]]
    rng = random.Random(0)
    seqs += [[rng.choice(edges) if rng.random() < 0.7 else rng.randrange(256) for _ in range(rng.randrange(4, 9))]
             for _ in range(1500)]
    fast = tok._tokenizer
    for seq in seqs:
        assert fast.decode([byte_id[b] for b in seq]) == bytes(seq).decode("utf-8", "replace"), seq

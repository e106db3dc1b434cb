"""Reasoning parsers (``--reasoning-parser``): the split of a finished output, and streaming that
sends pieces adding up to that split whatever the chunking, with no part of a tag leaking."""
from __future__ import annotations

import random

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser

CASES = [  # text, deepseek_r1's split, qwen3's split
    ("<think>plan a</think>\n\nanswer", ("plan a", "\n\nanswer"), ("plan a", "\n\nanswer")),
    ("plan b</think>answer", ("plan b", "answer"), (None, "plan b</think>answer")),
    ("no tags at all", ("no tags at all", None), (None, "no tags at all")),
    ("<think>never closed", ("never closed", None), ("never closed", None)),
    ("<think></think>only answer", (None, "only answer"), (None, "only answer")),
    ("<think>a</think>", ("a", None), ("a", None)),
    ("x <think>y</think>z", ("x <think>y", "z"), (None, "x <think>y</think>z")),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize("name,col", [("deepseek_r1", 1), ("qwen3", 2)])
def test_split_of_a_finished_output(name, col):
    parser = get_reasoning_parser(name)
    for case in CASES:
        assert parser.split(case[0]) == case[col], case[0]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_streamed_pieces_add_up_to_the_split(name):
    parser = get_reasoning_parser(name)
    rng = random.Random(0)
    texts = [c[0] for c in CASES] + ["<think>a</thinking> still</think> done", "<think>x</", "</think>", "<"]
    for text in texts:
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 6)))) if len(text) > 1 \
                else []
            want_r, want_c = parser.split(text)
            stream, reasoning, content = ReasoningStream(parser), "", ""
            for end in cuts + [len(text)]:
                new, content = stream.delta(text[:end], end == len(text))
                reasoning += new or ""
                # Every step's pieces are prefixes of the final split: no tag, or part of one, leaks.
                assert (want_r or "").startswith(reasoning) and (want_c or "").startswith(content), (text, end)
            assert (reasoning or None, content or None) == (want_r, want_c), (text, cuts)


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("r1")

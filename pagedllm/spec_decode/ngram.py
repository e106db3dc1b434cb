"""N-gram proposer (prompt lookup decoding, Saxena 2023; vLLM's ``ngram`` method): the last n tokens of
a sequence (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in its
own prompt + output, and the k tokens that followed the latest earlier occurrence are proposed. No
model runs: on text that copies its context (summaries, edits, code) the proposals are often right.

The search is ``bytes.rfind`` over the token ids packed as int32 (C speed; a hit must start on a
4-byte boundary), so a step costs O(context) C work a sequence, not Python work.
"""
from __future__ import annotations

from array import array


class NgramProposer:
    """``propose(token_ids, k)`` -> up to k token ids (an empty list where no n-gram matches).

    Args:
        min_n, max_n: the n-gram lengths tried, longest first (vLLM's prompt_lookup_min/max).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        num = len(token_ids)
        if k <= 0 or num < self.min_n + 1:
            return []
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            pattern = data[(num - n) * 4:]
            end = (num - 1) * 4  # an occurrence must end before the last token: one token at least follows it
            while True:
                pos = data.rfind(pattern, 0, end)
                if pos < 0:
                    break
                if pos % 4 == 0:
                    start = pos // 4 + n
                    return token_ids[start:start + k]
                end = pos + len(pattern) - 1  # a misaligned hit: look further left
        return []

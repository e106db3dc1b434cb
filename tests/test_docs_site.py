"""The documentation site, built as CI builds it (``mkdocs build --strict``), opened in headless Chromium
(the dashboard test's browser and skip rule): every page renders without a console error, and the
search box finds "tensor parallel" on the parallelism page."""
from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from test_dashboard import CHROMIUM

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site, served over HTTP on a free loopback port (search loads its index with fetch)."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield out, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_every_page_of_the_nav_is_built(site):
    out, _ = site
    for page in ("index", "quickstart", "serving", "request_fields", "offline", "models", "cli", "environment",
                 "cpu", "gpu", "quantization", "structured_outputs", "parallelism", "dashboard", "benchmarks",
                 "architecture", "troubleshooting"):
        assert (out / ("index.html" if page == "index" else f"{page}/index.html")).is_file(), page
    assert "Benchmarks: throughput, latency" in (out / "journal" / "index.html").read_text()  # the lab notebook


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian package 'chromium')")
def test_site_in_a_browser(site):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    out, url = site
    pages = sorted(str(p.parent.relative_to(out)) for p in out.rglob("index.html"))
    assert len(pages) >= 18
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(f"{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            # (a favicon still loading when the next page opens is aborted: not a failure of the page)
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} ({r.failure})")
                    if "ERR_ABORTED" not in (r.failure or "") else None)
            for rel in pages:
                page.goto(f"{url}/{'' if rel == '.' else rel + '/'}", wait_until="load")
                assert page.locator("h1").count() >= 1, rel
                assert not errors, (rel, errors)

            page.goto(url + "/", wait_until="load")
            box = page.locator("input.md-search__input")  # the header's search box (a desktop-wide window)
            box.click()
            box.press_sequentially("tensor parallel", delay=30)  # key by key, as the search box listens
            first = page.locator(".md-search-result__item a").first
            first.wait_for(state="attached", timeout=30_000)
            hrefs = page.eval_on_selector_all(".md-search-result__item a", "els => els.map(e => e.href)")
            assert any("/parallelism/" in h for h in hrefs), hrefs
            assert not errors, errors
        finally:
            browser.close()

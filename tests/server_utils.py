"""Start ``pagedllm serve`` as a real subprocess on a free loopback port, for the server tests."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one Prometheus sample (summed over label sets matching ``labels``)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found and not labels:
        raise KeyError(name)
    return total


class RemoteServer:
    """``with RemoteServer(model_dir, [...extra flags]) as srv:`` -> srv.url, srv.proc.

    Leaving the block stops the server with SIGTERM (``stop_signal``) and kills it if it has not
    exited after ``stop_timeout`` seconds; ``returncode`` then holds its exit status."""

    def __init__(self, model_dir: str, extra_args: tuple = (), env: Optional[dict] = None, log_path: str = "",
                 startup_timeout: float = 240.0, stop_timeout: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir, "--port", str(self.port),
                     *extra_args]
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.log_path = log_path or f"/tmp/pagedllm-server-{self.port}.log"
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.returncode: Optional[int] = None

    def __enter__(self) -> "RemoteServer":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {self.startup_timeout}s:\n{self.log()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, sig: int = signal.SIGTERM) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        if not self._log.closed:
            self._log.close()
        return self.returncode

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-5000:]
        except OSError:
            return ""


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> str:
    """/metrics text once the engine is idle: nothing running or waiting, no KV block in use."""
    deadline = time.time() + timeout
    while True:
        text = http.get("/metrics").text
        if metric(text, "pagedllm:num_requests_running") == 0 and metric(text, "pagedllm:kv_cache_usage_perc") == 0 \
                and metric(text, "pagedllm:num_requests_waiting") == 0:
            return text
        assert time.time() < deadline, text
        time.sleep(0.05)


def wait_unhealthy(srv: "RemoteServer", within_s: float = 60.0, poll_s: float = 0.2) -> None:
    """After killing part of a server (a worker, replica or node): wait until /health stops answering
    200 or the server exits, and assert that one of them happened within ``within_s`` (a hang guard)."""
    deadline = time.monotonic() + within_s
    status = 200
    while time.monotonic() < deadline and status == 200 and srv.proc.poll() is None:
        try:
            status = httpx.get(srv.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            break  # the server may already have exited
        time.sleep(poll_s)
    assert status == 503 or srv.proc.poll() is not None, srv.log()

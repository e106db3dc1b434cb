"""The Ray executor against a local Ray head on this machine (``ray start --head``): ``pagedllm
serve -tp 2 --distributed-executor-backend ray`` joins it (address "auto" via RAY_ADDRESS),
places rank 1 as an actor in a placement group, answers like one process, and when the actor's
process is killed /health turns 503 and the server exits non-zero. Skipped where Ray is not
installed (``pip install 'pagedllm[ray]'``); not in the default test extras (a Ray head takes
tens of seconds to start on a busy 2-core machine)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagedllm[ray]')")

from pagedllm import LLM, SamplingParams  # noqa: E402
from server_utils import RemoteServer, free_port, wait_unhealthy  # noqa: E402
from test_tensor_parallel import pid_alive, wait_gone  # noqa: E402

PROMPTS = [[10, 11, 12, 13], [99, 98, 97]]


def _pids_with(marker: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 with its own temp dir; stopped (all its processes) afterwards."""
    temp = f"/tmp/rt{free_port()}"  # short: Ray's socket paths must stay under 108 bytes
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "head.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    with open(log, "wb") as out:
        head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(port),
                                 "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--include-dashboard=false",
                                 "--disable-usage-stats", "--temp-dir", temp, "--block"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while b"Ray runtime started" not in log.read_bytes():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        for pid in _pids_with(temp.encode()):  # processes of this head only (its temp dir)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def complete(url: str, prompt: list[int]) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_ray_workers_answer_like_one_process_and_fail_loudly(ray_head, llama_dir, tmp_path):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].text for o in LLM(llama_dir, kv_cache_memory=1 << 22, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    args = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--kv-cache-memory", "4MiB",
            "--max-model-len", "256", "--served-model-name", "tiny", "--disable-access-log")
    with RemoteServer(llama_dir, args, env={"RAY_ADDRESS": ray_head}, log_path=str(tmp_path / "server.log"),
                      startup_timeout=300) as srv:
        assert "joined the running cluster" in srv.log()
        assert [complete(srv.url, p) for p in PROMPTS] == ref
        line = next(x for x in srv.log().splitlines() if "worker actors (pids" in x)
        (pid,) = [int(x) for x in line.split("(pids [")[1].split("]")[0].split(",")]
        assert pid_alive(pid)
        os.kill(pid, signal.SIGKILL)
        wait_unhealthy(srv, 60)  # a hang guard: the engine checks its workers every few seconds
        assert srv.proc.wait(60) not in (0, None), srv.log()
    assert wait_gone([pid], 5) == []

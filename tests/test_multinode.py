"""Multi-node launch on one machine as two "nodes": two separate ``pagedllm serve`` process trees
joined over 127.0.0.1 (``--nnodes 2 --master-addr/--master-port``), node 0 serving HTTP, node 1
``--headless``, one pipeline stage each. Answers equal one process's; a clean stop of node 0
stops node 1 with exit 0; a node that dies (either one) makes the other exit non-zero within a
bounded time, with /health 503 on node 0, and no process is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from server_utils import RemoteServer, free_port, wait_unhealthy
from test_tensor_parallel import all_spawned, pid_alive, spawned_children, wait_gone

COMMON = ("--pipeline-parallel-size", "2", "--kv-cache-memory", "4MiB", "--max-model-len", "256")
PROMPTS = [[10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [99, 98, 97]]


class TwoNodes:
    """Node 1 (headless) started first, then node 0 (the server); both on one rendezvous port."""

    def __init__(self, model_dir: str, log_dir) -> None:
        port = free_port()
        flags = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *COMMON)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.node1_log = open(log_dir / "node1.log", "wb")
        self.node1 = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir, "--node-rank", "1", "--headless",
             *flags], stdout=self.node1_log, stderr=subprocess.STDOUT, env=env)
        self.server = RemoteServer(model_dir, ("--node-rank", "0", *flags, "--served-model-name", "tiny",
                                               "--disable-access-log"), log_path=str(log_dir / "node0.log"))

    def __enter__(self) -> "TwoNodes":
        try:
            self.server.__enter__()
        except BaseException:
            self.close()
            raise
        self.node1_ranks = spawned_children(self.node1.pid)
        self.node0_spawned = all_spawned(self.server.proc.pid)  # node 0's engine core (which is rank 0)
        self.pids = self.node1_ranks + self.node0_spawned
        return self

    def node1_text(self) -> str:
        with open(self.node1_log.name, errors="replace") as f:
            return f.read()[-4000:]

    def close(self) -> None:
        self.server.stop()
        if self.node1.poll() is None:
            self.node1.send_signal(signal.SIGTERM)
            try:
                self.node1.wait(30)
            except subprocess.TimeoutExpired:
                self.node1.kill()
                self.node1.wait()
        self.node1_log.close()

    def __exit__(self, *exc) -> None:
        self.close()


def complete(url: str, prompt: list[int]) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_nodes_answer_like_one_and_stop_cleanly(llama_dir, tmp_path):
    ref_llm = LLM(llama_dir, kv_cache_memory=1 << 22, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].text for o in ref_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                        use_tqdm=False)]
    del ref_llm
    with TwoNodes(llama_dir, tmp_path) as nodes:
        assert len(nodes.node1_ranks) == 1  # node 1's one rank
        # node 0's rank 0 is its engine core process, which starts no worker of its own here
        assert len(nodes.node0_spawned) == 1
        assert [complete(nodes.server.url, p) for p in PROMPTS] == ref
        assert "pp=2" in nodes.server.log()
        assert nodes.server.stop() == 0, nodes.server.log()
        assert nodes.node1.wait(30) == 0, nodes.node1_text()  # told to stop by node 0
    assert wait_gone(nodes.pids, 10) == []


@pytest.mark.parametrize("victim", ["node1", "node0"])
def test_dead_node_is_loud(llama_dir, tmp_path, victim):
    with TwoNodes(llama_dir, tmp_path) as nodes:
        complete(nodes.server.url, PROMPTS[0])
        if victim == "node1":
            os.kill(nodes.node1.pid, signal.SIGKILL)  # the whole node: its rank follows its parent
            wait_unhealthy(nodes.server, 60)  # a hang guard: node 0 pings idle ranks every 2 s
            assert nodes.server.proc.wait(30) not in (0, None), nodes.server.log()
        else:
            nodes.server.proc.kill()
            nodes.server.proc.wait(10)
            assert nodes.node1.wait(60) not in (0, None), nodes.node1_text()  # its rank lost node 0
    assert wait_gone(nodes.pids, 15) == []
    assert not pid_alive(nodes.node1.pid) and not pid_alive(nodes.server.proc.pid)

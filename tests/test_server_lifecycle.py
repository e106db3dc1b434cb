"""Server life cycle: CLI help, API keys (flag and environment), SIGTERM/SIGINT with requests in
flight (exit code 0), a busy port, and the async engine's abort / engine-death paths in-process."""
from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from conftest import assert_pool_empty
from server_utils import RemoteServer

KEY = "s3cret-key"
SERVE_FLAGS = ["--host", "--port", "--dtype", "--api-key", "--tensor-parallel-size", "--gpu-memory-utilization",
               "--kv-cache-memory", "--max-model-len", "--served-model-name", "--block-size", "--max-num-seqs",
               "--max-num-batched-tokens", "--seed", "--chat-template", "--load-format", "--log-level",
               "--enable-prefix-caching", "--no-enable-prefix-caching", "--num-threads"]
COMMON = ("--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", "2MiB",
          "--disable-access-log")


def test_cli_help():
    top = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "serve" in top.stdout
    serve = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--help"],
                           capture_output=True, text=True)
    assert serve.returncode == 0
    help_text = " ".join(serve.stdout.split())
    for flag in SERVE_FLAGS:
        assert flag in help_text, flag
    for default in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 0.9)", "(default: 16)",
                    "(default: auto)", "(default: 256)", "PAGEDLLM_API_KEY"):
        assert default in help_text, default


def test_port_in_use_is_one_line_error(llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_dir, "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and str(port) in err, err


def test_api_key_flag_chat_template_and_sigint(llama_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    args = COMMON + ("--api-key", KEY, "--chat-template", str(template))
    with RemoteServer(llama_dir, args, log_path=str(tmp_path / "log")) as srv:
        tok = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        text = httpx.post(srv.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
        assert text == "[user] hi\n[assistant]"  # --chat-template replaces the tokenizer's template
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        r = good.completions.create(model="tiny", prompt="the king", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        assert [m.id for m in good.models.list().data] == ["tiny"]
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY + "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="tiny", prompt="the king", max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"})  # any case of the scheme
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        for headers in ({}, {"Authorization": KEY}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer  {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": f"Bearer {KEY[:-1]}"}):
            r = httpx.post(srv.url + "/v1/chat/completions", headers=headers,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200  # stays open
        srv.stop(signal.SIGINT)
        assert srv.returncode == 0, srv.log()


def test_sigterm_with_request_in_flight_exits_zero(llama_dir, tmp_path):
    with RemoteServer(llama_dir, COMMON + ("--shutdown-timeout", "30"), env={"PAGEDLLM_API_KEY": KEY},
                      log_path=str(tmp_path / "log")) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401  # key taken from the environment
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        stream = client.completions.create(model="tiny", prompt="the king", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].index == 0
        pieces: list = []
        reader = threading.Thread(target=lambda: pieces.extend(stream))
        reader.start()
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert srv.proc.wait(120) == 0, srv.log()
        # the request in flight was allowed to finish
        assert pieces and pieces[-1].choices[0].finish_reason == "length"
        with pytest.raises(httpx.ConnectError):  # nothing listens any more
            httpx.get(srv.url + "/health", timeout=5)


# ---- in-process: the async engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(llama_dir):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=256, kv_cache_memory=2 * 2 ** 20,
                                                device="cpu"))
    yield eng
    eng.shutdown()


def test_async_engine_abort_frees_blocks(engine):
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.sampling_params import SamplingParams

    llm = AsyncLLM(engine).start()
    try:
        async def run():
            params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
            gen = llm.generate("the king", params, "a")
            seen = 0
            async for out in gen:
                seen = len(out.outputs[0].token_ids)
                if seen >= 3:
                    break
            await gen.aclose()
            # a cancelled consumer aborts too
            task = asyncio.ensure_future(_consume(llm.generate("the queen", params, "b")))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            done = [o async for o in llm.generate("the lord", SamplingParams(max_tokens=5, temperature=0.0), "c")]
            return seen, done

        seen, done = asyncio.run(run())
        assert 3 <= seen < 200
        assert done[-1].finished and len(done[-1].outputs[0].token_ids) == 5
        deadline = 100
        while (engine.has_unfinished_requests() or llm.snapshot.stats.kv_cache_usage) and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        assert_pool_empty(engine)
        assert llm.snapshot.stats.kv_cache_usage == 0 and llm.snapshot.stats.num_running == 0
    finally:
        llm.shutdown(shutdown_engine=False)  # the engine is shared with the next test


async def _consume(gen):
    async for _ in gen:
        pass


def test_engine_death_fails_requests_and_health(engine, monkeypatch):
    from starlette.testclient import TestClient

    from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.sampling_params import SamplingParams

    llm = AsyncLLM(engine).start()
    app = build_app(llm, "tiny", shutdown_engine=False)
    client = TestClient(app)
    assert client.get("/health").status_code == 200

    def broken_step():
        raise RuntimeError("CUDA error: device-side assert (simulated)")

    monkeypatch.setattr(engine, "step", broken_step)

    async def run():
        return [o async for o in llm.generate("the king", SamplingParams(max_tokens=5), "x")]

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    assert llm.errored
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 2})
    assert r.status_code == 503 and "error" in r.json()
    monkeypatch.undo()
    engine.abort_request("x")
    assert_pool_empty(engine)


def test_priority_reaches_the_engine_from_each_endpoint(llama_dir, monkeypatch):
    """--scheduling-policy priority: the priority field of completions, chat and Responses requests
    reaches the engine's requests (in-process server)."""
    from starlette.testclient import TestClient

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    eng = LLMEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=256, kv_cache_memory=2 * 2 ** 20,
                                                device="cpu", scheduling_policy="priority"))
    seen = []
    real = eng.add_request

    def spy(request_id, prompt, params=None, arrival_time=None, priority=0, **kwargs):
        seen.append(priority)
        return real(request_id, prompt, params, arrival_time=arrival_time, priority=priority, **kwargs)

    monkeypatch.setattr(eng, "add_request", spy)
    llm = AsyncLLM(eng).start()
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            assert client.post("/v1/completions", json={"prompt": "the king", "max_tokens": 2,
                                                        "priority": 7}).status_code == 200
            assert client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -2}).status_code == 200
            assert client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                      "priority": 3}).status_code == 200
    finally:
        llm.shutdown()
    assert seen == [7, -2, 3]

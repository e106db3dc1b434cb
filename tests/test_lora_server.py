"""LoRA adapters over the OpenAI API: --lora-modules (both forms), /v1/models with parents, a request's
``model`` picking an adapter, load/unload while a stream runs, 404 and 400 bodies, the pool empty after."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from conftest import assert_pool_empty, build_checkpoint
from server_utils import RemoteServer
from test_lora import make_adapter, peft_greedy

pytest.importorskip("peft")

PROMPT = [11, 42, 97, 150, 33, 8, 71]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    d = build_checkpoint(str(root / "base"), "llama", seed=5)
    sql = make_adapter(d, str(root / "sql"), 4, 8, False, ["q_proj", "v_proj"], seed=1)
    chat = make_adapter(d, str(root / "chat"), 8, 16, True, ["q_proj", "o_proj", "gate_proj", "down_proj"], seed=2)
    law = make_adapter(d, str(root / "law"), 16, 16, False, ["k_proj", "up_proj"], seed=3)
    big = make_adapter(d, str(root / "big"), 32, 32, False, ["q_proj"], seed=4)
    return d, {"sql": sql, "chat": chat, "law": law, "big": big}, root


def expected_text(d, adapter, tok, n):
    from test_lora import MAX_TOKENS
    assert n == MAX_TOKENS
    # (the incremental detokenizer holds back a trailing incomplete UTF-8 character)
    return tok.decode(peft_greedy(d, adapter, [PROMPT])[0], skip_special_tokens=True).rstrip("\ufffd")


@pytest.mark.parametrize("core_process", [False, True, 2], ids=["engine-thread", "engine-core-process", "dp2"])
def test_lora_server_in_process(setup, core_process):
    """The app over the engine in a thread (AsyncLLM) and over the engine core process (CoreClient: the
    adapters and each request's LoRARequest cross the ZeroMQ socket)."""
    from starlette.testclient import TestClient

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.core_client import CoreClient
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    d, ads, root = setup
    args = EngineArgs(model=d, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                      kv_cache_memory=4 << 20)
    if core_process:
        engine = None
        llm = CoreClient(args, int(core_process)).start()  # (2: two data-parallel cores; adapters go to both)
    else:
        engine = LLMEngine.from_engine_args(args)
        llm = AsyncLLM(engine).start()
    try:
        app = build_app(llm, "base", shutdown_engine=False, allow_runtime_lora_updating=True,
                        lora_modules=[f"sql={ads['sql']}",
                                      json.dumps({"name": "chat", "path": ads["chat"], "base_model_name": "base-x"})])
        client = TestClient(app)
        models = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("sql", "base"), ("chat", "base-x")]
        assert models[1]["root"] == ads["sql"]
        tok = llm.engine.tokenizer

        def complete(model, max_tokens=8):
            return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                        "temperature": 0, "ignore_eos": True})

        for model, path in (("sql", ads["sql"]), ("base", None), ("chat", ads["chat"])):
            r = complete(model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            assert r.json()["choices"][0]["text"].rstrip("\ufffd") == expected_text(d, path, tok, 8), model

        r = complete("nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # a stream runs with chat while adapters are loaded and unloaded
        streamed: list[str] = []

        def stream():
            with client.stream("POST", "/v1/completions", json={"model": "chat", "prompt": PROMPT, "max_tokens": 96,
                                                                 "temperature": 0, "ignore_eos": True,
                                                                 "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line[6:])["choices"][0]["text"])
        t = threading.Thread(target=stream)
        t.start()
        for _ in range(400):  # the stream is running
            if streamed:
                break
            threading.Event().wait(0.01)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "law", "lora_path": ads["law"]})
        assert r.status_code == 200, r.text
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "law", "lora_path": ads["law"]})
        assert r.status_code == 400 and "already" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": ads["big"]})
        assert r.status_code == 400 and "rank 32 is greater than max_lora_rank 16" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "empty", "lora_path": str(root)})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200
        t.join(120)
        assert not t.is_alive()
        import test_lora
        old, test_lora.MAX_TOKENS = test_lora.MAX_TOKENS, 96
        try:
            want = tok.decode(peft_greedy(d, ads["chat"], [PROMPT])[0], skip_special_tokens=True).rstrip("\ufffd")
        finally:
            test_lora.MAX_TOKENS = old
        assert "".join(streamed).rstrip("\ufffd") == want
        assert complete("chat").status_code == 404  # unloaded
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
        r = complete("law")
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"].rstrip("\ufffd") == expected_text(d, ads["law"], tok, 8)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base", "sql", "law"]
        if engine is None:  # the core's own counters: nothing running or waiting, every block free
            for _ in range(200):
                snaps = llm.snapshot.replicas or [llm.snapshot]
                if all((s.stats.num_running, s.stats.num_waiting) == (0, 0) and s.num_free_blocks == s.num_blocks
                       for s in snaps):
                    break
                threading.Event().wait(0.05)
            assert len(snaps) == int(core_process)
            for s in snaps:
                assert (s.stats.num_running, s.stats.num_waiting) == (0, 0)
                assert s.num_blocks > 0 and s.num_free_blocks == s.num_blocks
            return
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            threading.Event().wait(0.05)
        assert_pool_empty(engine)
    finally:
        llm.shutdown()


def test_lora_server_flags(setup):
    """The flags through `pagedllm serve`: the adapters served from start in the engine core process (the
    default mode), and a rank past --max-lora-rank refusing to start in the engine-thread mode
    (--no-engine-core-process), so each mode starts once with --enable-lora from the CLI (the adapters
    themselves in each mode: test_lora_server_in_process; both modes take the same EngineArgs)."""
    d, ads, _ = setup
    args = ("--dtype", "float32", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules",
            f"sql={ads['sql']}", json.dumps({"name": "chat", "path": ads["chat"]}), "--kv-cache-memory", "4MiB")
    with RemoteServer(d, args) as srv:
        ids = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        assert ids[1:] == ["sql", "chat"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "sql", "messages": [{"role": "user",
                                                                "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "sql"
        # runtime updates are off without the flag
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "law", "lora_path": ads["law"]})
        assert r.status_code == 400 and "allow-runtime-lora-updating" in r.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="greater than max_lora_rank 8"):
        with RemoteServer(d, ("--no-engine-core-process", "--dtype", "float32", "--enable-lora", "--max-lora-rank",
                              "8", "--lora-modules", f"law={ads['law']}", "--kv-cache-memory", "4MiB"),
                          startup_timeout=120):
            pass

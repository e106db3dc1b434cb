"""The pooling runner (embeddings): each prompt's last hidden state, L2-normalized, equals what
transformers' base model gives (within float32 rounding), through chunked prefill, prefix caching and
pipeline stages; base-model checkpoints without an LM head load; ``/v1/embeddings`` answers the
official ``openai`` client (base64 and float encodings, dimensions, token-id inputs) and refuses
bad input with 400s; the text endpoints refuse the pooling runner and the embeddings endpoint the
generating one."""
from __future__ import annotations

import base64
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import assert_pool_empty, build_checkpoint
from pagedllm import LLM
from server_utils import RemoteServer
from test_correctness import make_prompts

MODEL = "tiny-embed"
LENS = [1, 5, 17, 40, 96, 150]


def reference_embeddings(model_dir: str, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' base model: the last token's final hidden state of each prompt, normalized."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    """A Qwen3 checkpoint saved as embedding models ship: the base model (``Qwen3Model``), no LM head."""
    d = build_checkpoint(str(tmp_path_factory.mktemp("qwen3_embed")), "qwen3", seed=5)
    base = transformers.AutoModel.from_pretrained(d, dtype=torch.float32)
    base.save_pretrained(d)
    assert "lm_head.weight" not in load_file(os.path.join(d, "model.safetensors"))
    return d


def embeddings(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_embed_matches_transformers_chunked_and_cached(embed_dir):
    vocab = transformers.AutoConfig.from_pretrained(embed_dir).vocab_size
    prompts = make_prompts(vocab, LENS, seed=2)
    ref = reference_embeddings(embed_dir, prompts)
    llm = LLM(embed_dir, runner="pooling", kv_cache_memory=2 << 20, max_num_batched_tokens=48)
    assert llm.llm_engine.config.model_config.architecture == "Qwen3Model"
    outs = llm.embed(prompts, use_tqdm=False)
    got = embeddings(outs)
    assert got.shape == (len(prompts), 64) and [o.prompt_token_ids for o in outs] == prompts
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(prompts)))
    assert_pool_empty(llm)
    # Again: the prompts' full blocks come from the prefix cache; the last token is computed anew.
    again = llm.embed(prompts, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 16 * 16 for n in LENS]
    torch.testing.assert_close(embeddings(again), got, rtol=0, atol=1e-6)
    last = llm.embed([{"prompt_token_ids": prompts[5]}], truncate_prompt_tokens=20, use_tqdm=False)
    torch.testing.assert_close(embeddings(last)[0], reference_embeddings(embed_dir, [prompts[5][-20:]])[0],
                               rtol=0, atol=2e-6)
    whole = llm.embed([tuple(prompts[5])], truncate_prompt_tokens=-1, use_tqdm=False)  # -1: max_model_len
    torch.testing.assert_close(embeddings(whole), got[5:], rtol=0, atol=1e-6)
    for bad in (torch.tensor([1, 2, 3]), 7, [1.0, 2.0], [[True, 5]]):
        with pytest.raises(ValueError, match="prompt|token ids"):
            llm.embed(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="use embed()"):
        llm.generate(prompts[:1])
    with pytest.raises(ValueError, match="prompt has 2000 tokens"):
        llm.embed([[7] * 2000])
    assert_pool_empty(llm)


def test_causal_lm_checkpoint_and_pipeline_stages(tmp_path):
    """A causal LM's checkpoint (LM head and all) embeds the same; pipeline stages send the
    embedding rows back; the generating runner refuses embed()."""
    d = build_checkpoint(str(tmp_path), "llama", seed=9)
    vocab = transformers.AutoConfig.from_pretrained(d).vocab_size
    prompts = make_prompts(vocab, [3, 30, 70], seed=4)
    ref = reference_embeddings(d, prompts)
    llm = LLM(d, runner="pooling", kv_cache_memory=1 << 20, pipeline_parallel_size=2)
    try:
        torch.testing.assert_close(embeddings(llm.embed(prompts, use_tqdm=False)), ref, rtol=0, atol=2e-6)
        assert_pool_empty(llm)
    finally:
        llm.llm_engine.shutdown()
    gen = LLM(d, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="runner='pooling'"):
        gen.embed(prompts)


def test_base_model_without_the_pooling_runner_says_so(embed_dir):
    with pytest.raises(ValueError, match=r"missing weights: \['lm_head.weight'\].*--runner pooling"):
        LLM(embed_dir, kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def server(embed_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed_server")
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "2MiB", "--runner", "pooling")
    with RemoteServer(embed_dir, args, log_path=str(tmp / "server.log")) as srv:
        yield srv
    assert srv.returncode == 0, srv.log()


def test_openai_client_embeddings(client, http, embed_dir):
    vocab = transformers.AutoConfig.from_pretrained(embed_dir).vocab_size
    ids = make_prompts(vocab, [12, 40], seed=7)
    tok = transformers.AutoTokenizer.from_pretrained(embed_dir)
    text = "the king said to the queen"
    ref = reference_embeddings(embed_dir, [tok.encode(text), *ids])
    r = client.embeddings.create(model=MODEL, input=[text])  # the client asks for base64 and decodes it
    assert r.model == MODEL and len(r.data) == 1 and r.usage.prompt_tokens == len(tok.encode(text))
    torch.testing.assert_close(torch.tensor(r.data[0].embedding), ref[0], rtol=0, atol=2e-6)
    r = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1] and r.usage.total_tokens == 52
    torch.testing.assert_close(torch.tensor([d.embedding for d in r.data]), ref[1:], rtol=0, atol=2e-6)
    r = client.embeddings.create(model=MODEL, input=text, dimensions=16, encoding_format="float")
    torch.testing.assert_close(torch.tensor(r.data[0].embedding),
                               torch.nn.functional.normalize(ref[0, :16], dim=-1), rtol=0, atol=2e-6)
    body = http.post("/v1/embeddings", json={"model": MODEL, "input": ids[0], "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(raw.copy()), ref[1], rtol=0, atol=2e-6)
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": [[5] * 300]}, "input", "maximum context length is 256"),
    ({"input": "hi", "dimensions": 65}, "dimensions", "more than the model's 64"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": [10 ** 9]}, "input", "token ids must be integers"),
    ({"input": [True, False]}, "input", ""),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 (max_model_len) or at least 1"),
])
def test_bad_embedding_requests_get_400(http, body, param, words):
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert http.get("/health").status_code == 200


def test_text_endpoints_refuse_the_pooling_runner(http):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"})):
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400 and "use /v1/embeddings" in r.json()["error"]["message"], (path, r.text)


def test_chat_form_embeds_the_rendered_conversation(http, embed_dir):
    """vLLM's chat form: messages rendered with the chat template (no generation prompt unless asked)
    and embedded as one input; input and messages together, or neither, are a 400."""
    from pagedllm.llm import apply_chat_template

    tok = transformers.AutoTokenizer.from_pretrained(embed_dir)
    msgs = [{"role": "user", "content": "the king said"}]
    for agp in (False, True):
        body = http.post("/v1/embeddings", json={"model": MODEL, "messages": msgs, "encoding_format": "float",
                                                  "add_generation_prompt": agp}).json()
        ids = apply_chat_template(tok, msgs, add_generation_prompt=agp)
        assert body["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]),
                                   reference_embeddings(embed_dir, [ids])[0], rtol=0, atol=2e-6)
    for bad in ({"input": "hi", "messages": msgs}, {}):
        r = http.post("/v1/embeddings", json={"model": MODEL, **bad})
        assert r.status_code == 400 and "exactly one of input or messages" in r.json()["error"]["message"]

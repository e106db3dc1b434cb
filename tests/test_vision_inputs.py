"""Image inputs from requests: data:/file:///http(s) URLs and their limits, malformed images (a fuzz),
--limit-mm-per-prompt, images for a text-only model; and a real ``pagedllm serve`` of a tiny LLaVA
(engine core process: the processed images travel over ZeroMQ) answering chat ``image_url`` parts and
Responses ``input_image`` parts as the offline engine does, every bad input a 400 naming its part,
the encoder cache's hits in /metrics, the engine serving on afterwards."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import random
import threading

import httpx
import pytest
from PIL import Image

from conftest import assert_pool_empty
from pagedllm import LLM, SamplingParams
from pagedllm.multimodal.media import MediaError, MediaLimits, decode_image, load_image_url
from server_utils import RemoteServer, metric
from vision_utils import build_llava, data_url, make_image

MODEL = "tiny-llava"
N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


# ---- media loading (no model) ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_decode(fmt):
    img = make_image(5)
    got = load_image_url(data_url(img, fmt), MediaLimits())
    assert got.size == img.size and got.mode == "RGB"
    if fmt == "PNG":  # lossless
        assert got.tobytes() == img.tobytes()


@pytest.mark.parametrize("url, reason", [
    ("data:image/png;base64,!!!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello world").decode(), "not an image in a supported format"),
    ("data:text/plain;base64,aGk=", "unsupported media type"),
    ("data:image/png,rawbytes", "only base64"),
    ("ftp://host/x.png", "unsupported URL scheme"),
    ("http://127.0.0.1:9/x.png", "--allow-remote-media"),
    ("file:///etc/hostname", "--allowed-local-media-path"),
])
def test_bad_urls_name_why(url, reason):
    with pytest.raises(MediaError, match=reason.replace("(", r"\(")):
        load_image_url(url, MediaLimits(), "image_url")


def test_unsupported_format_and_limits(tmp_path):
    img = make_image(6, (64, 48))
    with pytest.raises(MediaError, match="supported format"):
        decode_image(encoded(img, "TIFF"), MediaLimits())
    with pytest.raises(MediaError, match="pixels, more than the limit of 1000"):
        decode_image(encoded(img, "PNG"), MediaLimits(max_pixels=1000))
    with pytest.raises(MediaError, match="bytes, more than the limit of 100"):
        decode_image(encoded(img, "PNG"), MediaLimits(max_bytes=100))
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(encoded(img, "PNG"))
    (tmp_path / "b.png").write_bytes(encoded(img, "PNG"))
    limits = MediaLimits(allowed_local_media_path=str(tmp_path / "ok"))
    assert load_image_url(f"file://{tmp_path}/ok/a.png", limits).size == (64, 48)
    with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
        load_image_url(f"file://{tmp_path}/ok/../b.png", limits)
    with pytest.raises(MediaError, match="cannot read"):
        load_image_url(f"file://{tmp_path}/ok/missing.png", limits)


@pytest.fixture(scope="module")
def http_images(tmp_path_factory):
    """A local http.server serving a folder with a PNG (no internet here)."""
    root = tmp_path_factory.mktemp("www")
    (root / "a.png").write_bytes(encoded(make_image(7), "PNG"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_remote_urls_only_with_the_flag(http_images):
    url = http_images + "/a.png"
    with pytest.raises(MediaError, match="--allow-remote-media"):
        load_image_url(url, MediaLimits())
    got = load_image_url(url, MediaLimits(allow_remote_media=True))
    assert got.tobytes() == make_image(7).tobytes()
    with pytest.raises(MediaError, match="cannot fetch"):
        load_image_url(http_images + "/missing.png", MediaLimits(allow_remote_media=True))
    with pytest.raises(MediaError, match="more than the limit"):
        load_image_url(url, MediaLimits(allow_remote_media=True, max_bytes=50))


def mutations(seed: int, n: int):
    """Malformed images: truncations, flipped bytes, spliced headers of PNG/JPEG/WebP/GIF/BMP files."""
    rng = random.Random(seed)
    sources = [encoded(make_image(i, (24 + i, 20)), fmt) for i, fmt in enumerate(["PNG", "JPEG", "WEBP", "GIF", "BMP"])]
    for _ in range(n):
        data = bytearray(rng.choice(sources))
        kind = rng.randrange(4)
        if kind == 0:
            data = data[:rng.randrange(1, len(data))]
        elif kind == 1:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 2:
            data = data[:rng.randrange(8, 40)] + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        else:  # a header that claims a huge image
            data[16:24] = bytes([0x7f, 0xff, 0xff, 0xff] * 2) if data[:4] == b"\x89PNG" else data[16:24]
        yield bytes(data)


def test_fuzz_malformed_images_raise_media_error_only():
    """Every mutation either decodes to an RGB image or raises MediaError (never another exception)."""
    decoded = refused = 0
    for data in mutations(0, 300):
        try:
            img = decode_image(data, MediaLimits(max_pixels=10_000))
        except MediaError:
            refused += 1
            continue
        assert img.mode == "RGB" and img.width * img.height <= 10_000
        decoded += 1
    assert refused > 50 and decoded + refused == 300


# ---- the offline engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llava"))
    model, proc = build_llava(d)
    return d, model, proc


def test_offline_bad_inputs_and_the_engine_serves_on(llava):
    d, _, _ = llava
    llm = LLM(d, kv_cache_memory=4 << 20, limit_mm_per_prompt={"image": 2})
    img = make_image(8)
    good = {"prompt": "<|user|><image>the king<|assistant|>", "multi_modal_data": {"image": img}}
    want = llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    bad = [({"prompt": "<image><image><image>x", "multi_modal_data": {"image": [img] * 3}}, "more than the limit of 2"),
           ({"prompt": "<image><image>x", "multi_modal_data": {"image": [img]}}, "2 image placeholder"),
           ({"prompt": "x", "multi_modal_data": {"image": "not an image"}}, "PIL.Image"),
           ({"prompt": "x", "multi_modal_data": {"video": [img]}}, "'image' only"),
           ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": img}}, "needs its text")]
    for prompt, why in bad:
        with pytest.raises(ValueError, match=why):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    for data in mutations(1, 40):  # malformed images through LLM.chat: ValueError, or an answer
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(data).decode()}}, {"type": "text", "text": "hi"}]}]
        try:
            llm.chat(msgs, GREEDY, use_tqdm=False)
        except ValueError:
            pass
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    assert_pool_empty(llm)


def test_images_for_a_text_only_model(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory=2 << 20)
    with pytest.raises(ValueError, match="text-only model"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": make_image(1)}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(llama_dir, kv_cache_memory=2 << 20, limit_mm_per_prompt={"image": 1})


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llava, tmp_path_factory, http_images):
    d = llava[0]
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(encoded(make_image(9), "PNG"))
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--allowed-local-media-path", str(media), "--allow-remote-media", "--limit-mm-per-prompt",
            '{"image": 2}', "--disable-access-log")
    with RemoteServer(d, args, log_path=str(media / "server.log")) as srv:
        srv.media = media
        yield srv
    assert srv.returncode == 0, srv.log()


def chat(url: str, text: str = "the king", **kw) -> dict:
    return {"model": MODEL, "max_tokens": N, "temperature": 0, "ignore_eos": True, **kw,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": text}]}]}


def test_chat_image_url_forms_equal_offline(server, llava, http_images):
    d, model, proc = llava
    offline = LLM(d, kv_cache_memory=4 << 20)

    def want(img):
        msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                             {"type": "text", "text": "the king"}]}]
        return offline.chat(msgs, GREEDY, use_tqdm=False)[0].outputs[0].text

    with httpx.Client(base_url=server.url, timeout=120) as h:
        for url, img in [(data_url(make_image(9), "PNG"), make_image(9)),
                         (f"file://{server.media}/a.png", make_image(9)),
                         (http_images + "/a.png", make_image(7))]:
            r = h.post("/v1/chat/completions", json=chat(url))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want(img)
        r = h.post("/v1/responses", json={"model": MODEL, "max_output_tokens": N, "temperature": 0,
                                          "input": [{"role": "user", "content": [
                                              {"type": "input_image", "image_url": data_url(make_image(9))},
                                              {"type": "input_text", "text": "the king"}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == want(make_image(9))


def test_bad_image_inputs_are_400_naming_the_part(server):
    img = data_url(make_image(10))
    trunc = "data:image/png;base64," + base64.b64encode(encoded(make_image(10), "PNG")[:60]).decode()
    cases = [(chat("data:image/png;base64,!!"), "messages.0.content.0", "base64"),
             (chat(trunc), "messages.0.content.0", "cannot be decoded"),
             (chat("data:image/tiff;base64," + base64.b64encode(encoded(make_image(1), "TIFF")).decode()),
              "messages.0.content.0", "supported format"),
             (chat("file:///etc/hostname"), "messages.0.content.0", "outside --allowed-local-media-path"),
             (chat("gopher://x"), "messages.0.content.0", "scheme")]
    three = chat(img)
    three["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": img}}] * 3
    cases.append((three, "messages.0.content.2", "more than the limit of 2"))
    with httpx.Client(base_url=server.url, timeout=120) as h:
        for body, param, why in cases:
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (param, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == param and why in err["message"], err
        for data in mutations(2, 25):  # the fuzz through HTTP: 200 or 400, never 500
            url = "data:image/png;base64," + base64.b64encode(data).decode()
            assert h.post("/v1/chat/completions", json=chat(url)).status_code in (200, 400)
        assert h.post("/v1/chat/completions", json=chat(img)).status_code == 200  # the engine serves on


def test_malformed_image_url_parts_get_one_clear_sentence(server):
    """An image_url part without {"url": str} (missing, null, a bare string) or with a detail other than
    OpenAI's auto/low/high: a 400 saying so, naming the part, not pydantic's union dump."""
    img = data_url(make_image(3))
    cases = [({}, "needs"), ({"url": None}, "needs"), (img, "needs"), ({"url": img, "detail": "ultra"}, "detail")]
    with httpx.Client(base_url=server.url, timeout=120) as h:
        for image_url, why in cases:
            body = chat(img)
            body["messages"][0]["content"].insert(0, {"type": "text", "text": "see"})
            body["messages"][0]["content"][1] = {"type": "image_url", "image_url": image_url}
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages.0.content.1" and why in err["message"], err
            assert "more error" not in err["message"], err
        assert h.post("/v1/chat/completions", json=chat(img)).status_code == 200


def test_responses_bad_image_names_its_input_item(server):
    """The param of a bad input_image names the input item and part, with or without ``instructions``
    (which render as a system message before the input) and for a part the server cannot take."""
    bad = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    cases = [({}, [{"type": "input_text", "text": "hi"}, bad], "input.0.content.1"),
             ({"instructions": "be brief"}, [{"type": "input_text", "text": "hi"}, bad], "input.0.content.1"),
             ({}, [{"type": "input_image"}], "input.0.content.0"),
             ({}, [{"type": "input_image", "image_url": data_url(make_image(3))},
                   {"type": "input_file", "file_id": "f"}], "input.0.content.1")]
    with httpx.Client(base_url=server.url, timeout=120) as h:
        for extra, content, param in cases:
            r = h.post("/v1/responses", json={"model": MODEL, "max_output_tokens": N, **extra,
                                              "input": [{"role": "user", "content": content}]})
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())


def test_encoder_cache_hits_in_metrics(server):
    img = data_url(make_image(12))
    with httpx.Client(base_url=server.url, timeout=120) as h:
        before = metric(h.get("/metrics").text, "pagedllm:mm_cache_hits_total")
        assert h.post("/v1/chat/completions", json=chat(img, "the king")).status_code == 200
        assert h.post("/v1/chat/completions", json=chat(img, "and the queen of all")).status_code == 200
        text = h.get("/metrics").text
        assert metric(text, "pagedllm:mm_cache_hits_total") >= before + 1
        assert metric(text, "vllm:mm_cache_hits_total") == metric(text, "pagedllm:mm_cache_hits_total")


def test_in_thread_engine_serves_images(llava, tmp_path):
    """The engine in a thread of the server process (--no-engine-core-process): the same answers."""
    d = llava[0]
    img = make_image(9)
    offline = LLM(d, kv_cache_memory=4 << 20)
    want = offline.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                      {"type": "text", "text": "the king"}]}],
                        GREEDY, use_tqdm=False)[0].outputs[0].text
    args = ("--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB",
            "--no-engine-core-process", "--disable-access-log")
    with RemoteServer(d, args, log_path=str(tmp_path / "server.log")) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as h:
            for _ in range(2):
                r = h.post("/v1/chat/completions", json=chat(data_url(img)))
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text
            r = h.post("/v1/chat/completions", json=chat("data:image/png;base64,iVBORw0KGgo="))
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0"
            assert metric(h.get("/metrics").text, "pagedllm:mm_cache_hits_total") >= 1
    assert srv.returncode == 0, srv.log()

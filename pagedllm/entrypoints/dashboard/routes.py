"""``GET /dashboard``: the page (public: it holds no data and asks for the API key when the server has
one), its static files, and the data under ``/dashboard/api/`` (which needs the key like ``/v1/*``):

- ``/dashboard/api/info``: the start-up facts (model, dtype, KV blocks, block size, max concurrency);
- ``/dashboard/api/stream``: server-sent events: ``info`` and ``history`` once, then ``pool`` (a new
  ``PoolSnapshot``, about 2 a second while the pool changes) and ``sample`` (one
  chart point a second).
"""
from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import AsyncIterator

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.kv_cache_manager import max_blocks_per_seq
from pagedllm.entrypoints.dashboard.snapshot import History, PoolSampler

_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_TICK_S = 0.25       # how often a stream looks for a new snapshot
_SNAPSHOT_S = 0.45   # at most one engine snapshot per this many seconds (>= 2 a second): each costs the
                     # engine thread a list copy and the event loop a JSON encoding under the GIL


def _static(name: str) -> bytes:
    return resources.files("pagedllm.entrypoints.dashboard").joinpath("static", name).read_bytes()


def startup_facts(llm) -> dict:
    """Model, dtype, device, KV blocks and block size, and how many max_model_len sequences fit."""
    cfg = llm.engine.config
    mc, cc = cfg.model_config, cfg.cache_config
    blocks_per_seq = max_blocks_per_seq(mc.max_model_len, cc.block_size, cc.sliding_window,
                                        cfg.scheduler_config.max_num_batched_tokens)
    usable = cc.num_blocks - (cc.sliding_window is not None)  # (the null block)
    return {"model": mc.served_model_name, "path": str(mc.model), "architecture": mc.architecture,
            "dtype": str(mc.dtype).replace("torch.", ""), "device": cfg.device,
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "num_blocks": cc.num_blocks, "block_size": cc.block_size, "max_model_len": mc.max_model_len,
            "kv_cache_dtype": "int8" if cc.cache_dtype == "int8" else str(mc.dtype).replace("torch.", ""),
            "max_concurrency": max(usable, 0) / blocks_per_seq,
            "sliding_window": cc.sliding_window, "prefix_caching": bool(cc.enable_prefix_caching)}


def add_dashboard(app: FastAPI, llm, metrics) -> None:
    """Mount the dashboard on ``app`` over a started AsyncLLM ``llm`` and its ServerMetrics."""
    sampler = PoolSampler(_SNAPSHOT_S)
    history = History(lambda: llm.snapshot, metrics.latencies).start()
    if hasattr(llm, "watch_pool"):  # the engine core in its own process samples its pool and ships it
        llm.watch_pool(sampler.accept, sampler.interval_s)
    else:
        llm.on_step = sampler.on_step
    app.state.dashboard_history = history
    facts = startup_facts(llm)

    @app.get("/dashboard", include_in_schema=False)
    async def page():
        return Response(_static("index.html"), media_type="text/html",
                        headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in _STATIC:
            return JSONResponse({"error": {"message": f"no such file: {name}", "type": "not_found_error",
                                           "param": None, "code": None}}, status_code=404)
        return Response(_static(name), media_type=_STATIC[name])

    @app.get("/dashboard/api/info", include_in_schema=False)
    async def info():
        return facts

    async def events(request: Request) -> AsyncIterator[str]:
        sampler.watch(+1)
        llm.wake()
        try:
            yield _sse("info", facts)
            yield _sse("history", list(history.samples))
            sent_version, sent_samples = 0, len(history.samples)
            last_sample = history.samples[-1]["time"] if history.samples else 0.0
            while not _shutting_down(request):
                snap = sampler.latest
                if snap is not None and snap.version != sent_version:
                    sent_version = snap.version
                    yield _sse("pool", await asyncio.to_thread(snap.to_json))
                if history.samples and history.samples[-1]["time"] != last_sample:
                    point = history.samples[-1]
                    last_sample = point["time"]
                    yield _sse("sample", point)
                await asyncio.sleep(_TICK_S)
        finally:
            sampler.watch(-1)

    @app.get("/dashboard/api/stream", include_in_schema=False)
    async def stream(request: Request):
        return StreamingResponse(events(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _shutting_down(request: Request) -> bool:
    """True once uvicorn is stopping (run_server puts its Server in app.state): end the stream so that
    a graceful shutdown does not wait for an open dashboard."""
    server = getattr(request.app.state, "uvicorn_server", None)
    return bool(server is not None and server.should_exit)


def _sse(event: str, data) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


__all__ = ["add_dashboard", "startup_facts", "History", "PoolSampler"]

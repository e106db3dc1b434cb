"""CoreClient's lazy outputs (engine/core_client.py): a running one-sample request's output is built
when its caller reads it. A caller that reads every step and one that lags (reads every third step)
get the same final outputs; the lagging one reads fewer; /metrics sees every step either way. No
engine core process: the core's step messages are made here and fed to the reader's handler."""
import asyncio
import time

from pagedllm.engine import core_client as CC
from pagedllm.engine import core_protocol as P
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.metrics import ServerMetrics
from pagedllm.sampling_params import SamplingParams


class _NoSocket:
    def send(self, *args, **kwargs) -> None:
        pass


def _client(model_dir: str):
    """A CoreClient over no core process (its sockets discard what it sends), with the server's metrics."""
    config = EngineArgs(model=model_dir, max_model_len=128).create_engine_config()
    c = object.__new__(CC.CoreClient)
    c.replicas, c._route, c._reader, c._closed, c._on_pool, c._unread = [], {}, None, False, None, {}
    c._encoder, c._decoder = P.front_codec()
    c.replicas.append(CC._Replica(0, None, _NoSocket(), encoder=c._encoder))
    AsyncLLM.__init__(c, CC.FrontEngine(config))
    metrics = ServerMetrics(lambda: c.snapshot, "m")
    c.on_outputs = metrics.record_outputs
    return c, metrics


def _run(model_dir: str, num: int, steps: int, read_every: int):
    c, metrics = _client(model_dir)
    outputs = {i: [] for i in range(num)}

    async def main():
        async def read(i):
            async for out in c.generate({"prompt_token_ids": [5, 6, 7]},
                                        SamplingParams(max_tokens=steps, ignore_eos=True), f"r{i}"):
                outputs[i].append(out)

        tasks = [asyncio.ensure_future(read(i)) for i in range(num)]
        await asyncio.sleep(0)
        now = time.time()
        for step in range(steps):
            fin = "length" if step == steps - 1 else None
            deltas = [P.RequestDelta(f"r{i}", now, [P.SeqDelta(0, [40 + 13 * step + i], fin, None, None, 0.0, now, now,
                                                               now + step * 0.01, now + step * 0.01 if fin else None)], 0)
                      for i in range(num)]
            c._on_message(P.StepOutputs(0, deltas, P.CoreSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0)))
            if step % read_every == read_every - 1:
                for _ in range(3):
                    await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert not c._unread and not c.engine.output_processor.states and not c._streams
    itl_count = [s.value for family in metrics.registry.collect() for s in family.samples
                 if s.name == "pagedllm:inter_token_latency_seconds_count"]
    return outputs, itl_count


def test_lagging_caller_gets_the_same_outputs(llama_dir):
    num, steps = 3, 7
    eager, itl_eager = _run(llama_dir, num, steps, 1)
    lagging, itl_lagging = _run(llama_dir, num, steps, 3)
    for i in range(num):
        e, g = eager[i], lagging[i]
        assert len(e) == steps and 1 < len(g) < steps
        for outs in (e, g):
            counts = [len(o.outputs[0].token_ids) for o in outs]
            assert counts == sorted(counts) and outs[-1].finished and not any(o.finished for o in outs[:-1])
        final_e, final_g = e[-1].outputs[0], g[-1].outputs[0]
        assert (final_g.token_ids, final_g.text, final_g.finish_reason) == (final_e.token_ids, final_e.text, "length")
        assert len(final_g.token_ids) == steps
        # every output a lagging caller read is the eager caller's output of the same length
        by_len = {len(o.outputs[0].token_ids): o.outputs[0].text for o in e}
        assert all(by_len[len(o.outputs[0].token_ids)] == o.outputs[0].text for o in g)
    assert itl_eager == itl_lagging == [num * (steps - 1)]

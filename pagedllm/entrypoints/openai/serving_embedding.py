"""``/v1/embeddings``: OpenAI's Embeddings API over the pooling runner (``pagedllm serve MODEL
--runner pooling``; ``layers/pooler.py``). Every input is one engine request that ends with its
prompt; the inputs of one call run in the same batches."""
from __future__ import annotations

import base64
import time
from typing import Any

import torch
from starlette.requests import Request

from pagedllm.entrypoints.openai.protocol import (
    EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, RequestError, random_id)
from pagedllm.entrypoints.openai.serving_engine import (
    BIG_PROMPT_CHARS, OpenAIServing, merge_streams, run_unless_disconnected)
from pagedllm.sampling_params import SamplingParams


def encode_embedding(e: torch.Tensor, encoding_format: str):
    """float32 [D] -> a list of floats, or the base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(e.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
    return e.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    def __init__(self, llm, served_model_name: str, chat: Any) -> None:
        super().__init__(llm, served_model_name, chat.chat_template)
        self.chat = chat  # renders the chat form's messages (OpenAIServingChat)

    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request) -> dict:
        self.check_model(req.model)
        if not self.llm.engine.pooling:
            raise RequestError("this server generates text; /v1/embeddings needs a server started with "
                               "--runner pooling (an embedding model)", "model", 400, "model_not_supported")
        hidden = self.llm.model_config.hf_config.hidden_size
        if req.dimensions is not None and req.dimensions > hidden:
            raise RequestError(f"dimensions={req.dimensions} is more than the model's {hidden}", "dimensions")
        if req.messages is not None:  # one conversation, rendered as chat completions render it
            items = [self.chat.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template_kwargs)]
        else:
            items = req.inputs()
        offload = sum(len(p) for p in items if isinstance(p, str)) > BIG_PROMPT_CHARS
        prompt_ids = []
        for p in items:
            param = "messages" if req.messages is not None else "input"
            ids = await self.tokenize(p, param, offload=offload, add_special_tokens=req.add_special_tokens)
            if req.truncate_prompt_tokens is not None:  # (-1: to max_model_len, as vLLM)
                ids = ids[-(self.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens):]
            if len(ids) > self.max_model_len:
                raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens, but an "
                                   f"input has {len(ids)} tokens.", "input", code="context_length_exceeded")
            prompt_ids.append(ids)
        request_id = random_id("embd")
        params = SamplingParams(temperature=0.0, max_tokens=1)
        gens = [self.llm.generate({"prompt_token_ids": ids}, params, f"{request_id}-{i}")
                for i, ids in enumerate(prompt_ids)]

        async def collect() -> list:
            final: list = [None] * len(gens)
            async for i, out in merge_streams(gens):
                final[i] = out
            return final

        finals = await run_unless_disconnected(raw_request, collect())
        if any(out.pooled is None for out in finals):  # aborted: the server is shutting down
            raise RequestError("the request was aborted before its embeddings were computed (the server is "
                               "shutting down)", None, 503, "aborted", "service_unavailable")
        data = []
        for i, out in enumerate(finals):
            e = out.pooled
            if req.dimensions is not None:  # Matryoshka: the leading channels, normalized again
                e = torch.nn.functional.normalize(e[:req.dimensions], dim=-1)
            data.append(EmbeddingData(index=i, embedding=encode_embedding(e, req.encoding_format)))
        n = sum(len(ids) for ids in prompt_ids)
        return EmbeddingResponse(id=request_id, created=int(time.time()), model=self.served_model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)).model_dump()

"""Offline inference API, mirroring vLLM's ``LLM`` class.

    from pagedllm import LLM, SamplingParams
    llm = LLM()                                   # the bundled demo model
    outs = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.logger import init_logger
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """An engine for offline batches.

    Args:
        model: local Hugging Face folder, GGUF file (or a folder holding exactly one) or hub id;
            None = the bundled demo model.
        tokenizer: tokenizer folder, GGUF file or hub id; None = the model's (a GGUF's from its metadata).
        dtype: "auto" (on a CPU bfloat16 where it has native bf16 matmuls, else float32; the checkpoint's
            dtype on CUDA), "float32", "bfloat16", "float16".
        max_model_len: longest prompt + output in tokens (default: the config's context length).
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of device memory (of RAM on a CPU) the engine may use; None:
            0.9 on a GPU, and on a CPU (without kv_cache_memory) a fixed 4 GiB KV cache
            (``PAGEDLLM_CPU_KVCACHE_SPACE`` GiB).
        kv_cache_memory: KV-cache bytes per rank; overrides gpu_memory_utilization.
        max_num_seqs, max_num_batched_tokens: scheduler limits per step.
        tensor_parallel_size: number of ranks (processes) the model is sharded over.
        seed: seed of the global random state (unseeded sampling).
        load_format: "auto" (safetensors) or "dummy" (random weights).
        enable_prefix_caching: reuse K/V of shared prompt prefixes.
        num_threads: CPU threads (None: OMP_NUM_THREADS if set, else the physical cores).
        quantization: None, "int8" (W8A8: int8 weights per output channel, int8 activations per
            token, int32 matmuls; see ``layers/quantization/int8.py``) or "int8-g64" (activation
            scales per token and group of 64 features: closer to fp32, slower prefill).
        attention_backend: "auto" (the compiled CPU kernel on a CPU when it builds, else "torch"),
            "torch" (pure-PyTorch reference) or "cpu".
        pipeline_parallel_size: pipeline stages (layers split over processes; world = TP x PP).
        kv_cache_dtype: "auto" (the model's dtype) or "int8" (int8 K/V with a float32 scale per token
            and KV head: at head_dim 64 and block_size 16, 3.8x the tokens of a float32 cache and 1.9x
            bfloat16's in the same memory; see ``layers/attention/kv_quant.py``).
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's
            default, 20); ``generate`` raises ValueError above it.
        runner: "generate" (``generate``, ``chat``) or "pooling" (``embed``: embedding models such as
            Qwen3-Embedding or E5-Mistral; ``layers/pooler.py``).
        scheduling_policy: "fcfs" (arrival order) or "priority" (``generate(..., priority=[...])``,
            lower first; the least urgent running request is the one preempted).

    Raises:
        ValueError: an invalid setting, a model path that is not a loadable model (missing, unsupported
            architecture or quant type, corrupt or truncated file, weights that do not fit the config;
            one-line message), or a KV cache too small.
    """

    def __init__(self, model: Optional[str] = None, *, tokenizer: Optional[str] = None, dtype: str = "auto",
                 max_model_len: Optional[int] = None, block_size: int = 16, gpu_memory_utilization: Optional[float] = None,
                 kv_cache_memory: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, tensor_parallel_size: int = 1, seed: int = 0,
                 load_format: str = "auto", enable_prefix_caching: bool = True, device: Optional[str] = None,
                 num_threads: Optional[int] = None,
                 quantization: Optional[str] = None,
                 attention_backend: str = "auto", pipeline_parallel_size: int = 1,
                 kv_cache_dtype: str = "auto", max_logprobs: int = 20, runner: str = "generate",
                 scheduling_policy: str = "fcfs") -> None:
        init_logger()
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
                          block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                          kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=tensor_parallel_size,
                          seed=seed, load_format=load_format, enable_prefix_caching=enable_prefix_caching,
                          device=device, num_threads=num_threads, quantization=quantization,
                          attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype,
                          pipeline_parallel_size=pipeline_parallel_size, max_logprobs=max_logprobs, runner=runner,
                          scheduling_policy=scheduling_policy)
        self.llm_engine = LLMEngine.from_engine_args(args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``) to completion.
        ``priority``: one per prompt, lower first (needs ``scheduling_policy="priority"``).

        Returns one RequestOutput per prompt, in prompt order. Raises ValueError (before anything
        runs) for an invalid prompt, e.g. one longer than max_model_len.
        """
        if self.llm_engine.pooling:
            raise ValueError("this LLM runs the pooling runner (runner='pooling'): use embed(), or create it with "
                             "runner='generate' to generate")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, sp, prio in zip(prompts, params, priorities):
                ids.append(engine.add_request(None, prompt, sp, priority=prio))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], use_tqdm: bool = True,
              truncate_prompt_tokens: Optional[int] = None) -> list[EmbeddingRequestOutput]:
        """Embed prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``) with the pooling
        runner: each one's last hidden state, L2-normalized (``layers/pooler.py``).
        ``truncate_prompt_tokens``: keep only each prompt's last that many tokens (-1: max_model_len).

        Returns one EmbeddingRequestOutput per prompt, in prompt order (``.outputs.embedding``: a list
        of hidden_size floats). Raises ValueError when the LLM was not created with runner="pooling",
        or for an invalid prompt (empty, longer than max_model_len)."""
        engine = self.llm_engine
        if not engine.pooling:
            raise ValueError("embed() needs the pooling runner: create the LLM with runner='pooling'")
        prompts = _as_prompt_list(prompts)
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens == -1:
                truncate_prompt_tokens = engine.model_config.max_model_len
            if truncate_prompt_tokens < 1:
                raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, got "
                                 f"{truncate_prompt_tokens}")
            prompts = [{"prompt_token_ids": engine.tokenize_prompt(p)[1][-truncate_prompt_tokens:]} for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        ids = []
        try:
            for prompt in prompts:
                ids.append(engine.add_request(None, prompt, params))
        except Exception:
            engine.abort_request(ids)
            raise
        return [EmbeddingRequestOutput.from_request_output(o) for o in self._run_engine(ids, use_tqdm)]

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list
        of them, rendered with the tokenizer's chat template (or ``chat_template``)."""
        if not messages:
            return []
        if isinstance(messages, (str, dict)):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": apply_chat_template(
            self.get_tokenizer(), conv, chat_template, add_generation_prompt, continue_final_message,
            chat_template_kwargs)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        engine.final_outputs_only = True
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request(list(set(request_ids) - set(finished)))
            raise
        finally:
            engine.final_outputs_only = False
            bar.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Any) -> list:
    """One prompt (a string, a dict or a list of token ids) or a sequence of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt (a string, a list of token ids, a dict) or a list of them, "
                         f"got {type(prompts).__name__}")
    return list(prompts)


def apply_chat_template(tokenizer, messages: Messages, chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: Optional[dict] = None) -> list[int]:
    """Token ids of a conversation rendered with ``chat_template`` or the tokenizer's own.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts. Raises
    ValueError when the tokenizer has no chat template and none is given, or a message is not a
    dict with a string ``role`` and string, list or null ``content`` (any role name: templates
    define their own, e.g. Llama 3.1's ``ipython``). A ``developer`` message (OpenAI's name for the
    system instructions) becomes a ``system`` one for a template that never names that role.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the model's tokenizer has no chat template; pass one (--chat-template)")
    as_system = "developer" not in str(template)
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r:.200}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string, a list of content parts or null, "
                             f"got {type(content).__name__}")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
        norm.append({**m, "content": content if content is not None else ""})
        if as_system and m["role"] == "developer":
            norm[-1]["role"] = "system"
    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:
        add_generation_prompt = False
    text = tokenizer.apply_chat_template(norm, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)

"""Offline inference API, mirroring vLLM's ``LLM`` class.

    from pagedllm import LLM, SamplingParams
    llm = LLM()                                   # the bundled demo model
    outs = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import dataclasses
import difflib
import textwrap
import time
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs, cli_flag
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.logger import init_logger
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.chat import split_chat_images
from pagedllm.multimodal.media import limits_from
from pagedllm.sampling_params import SamplingParams

Messages = list[dict[str, Any]]

# Seconds between two redraws of generate's progress bar. A redraw (the meter formatted, its width
# measured, a write to stderr) costs about 0.1 ms: once per finished request, as it was, that was a
# tenth of a millisecond per request (a second for 10,000 one-token requests); 4 a second is nothing.
BAR_REFRESH_S = 0.25


class LLM:
    """An engine for offline batches.

    ``LLM(model=None, **settings)``: ``model`` is a local Hugging Face folder, GGUF file (or a folder holding
    exactly one) or hub id (None = the bundled demo model); the keywords are the fields of ``EngineArgs``
    (``pagedllm/engine/arg_utils.py``), the settings ``pagedllm serve`` takes as flags, with the same defaults
    (``kv_cache_memory`` in bytes). They are listed under "Settings" below, generated from those fields.

    Raises:
        TypeError: a keyword that is not an EngineArgs field (named, with the closest field).
        ValueError: an invalid setting, a model path that is not a loadable model (missing, unsupported
            architecture or quant type, corrupt or truncated file, weights that do not fit the config;
            one-line message), or a KV cache too small.
    """

    def __init__(self, model: Optional[str] = None, **settings: Any) -> None:
        init_logger()
        names = EngineArgs.field_names()
        for name in settings:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}: it takes the fields of "
                                f"EngineArgs ({', '.join(names)})")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **settings))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``) to completion.
        ``priority``: one per prompt, lower first (needs ``scheduling_policy="priority"``).
        ``lora_request``: the LoRA adapter of every prompt, or a list with one (or None) per prompt
        (needs ``enable_lora=True``).

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
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, sp, prio, lora in zip(prompts, params, priorities, loras):
                ids.append(engine.add_request(None, prompt, sp, priority=prio, lora_request=lora))
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
        of them, rendered with the tokenizer's chat template (or ``chat_template``). A content part may be an
        image: ``{"type": "image_url", "image_url": {"url": ...}}`` (data:, file:// under
        allowed_local_media_path, http(s) with allow_remote_media) or ``{"type": "image_pil", "image_pil": img}``."""
        if not messages:
            return []
        if isinstance(messages, (str, dict)):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        mm = self.llm_engine.mm_processor
        prompts = []
        for conv in conversations:  # image parts (image_url, image_pil) become the model's placeholder text
            conv, images = split_chat_images(conv, mm.placeholder if mm is not None else None,
                                             limits_from(self.llm_engine.model_config))
            text = render_chat(self.get_tokenizer(), conv, chat_template, add_generation_prompt,
                               continue_final_message, chat_template_kwargs)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}
                           if images else {"prompt_token_ids": self.get_tokenizer().encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of ``request_ids`` is finished; their final outputs,
        in that order. The progress bar is redrawn at most every ``BAR_REFRESH_S`` seconds (its
        count and tok/s computed only then) and once at the end with the final count."""
        engine = self.llm_engine
        engine.final_outputs_only = True
        finished: dict[str, RequestOutput] = {}
        # Every update() redraws (miniters=1, mininterval=0): the loop below decides when, not tqdm's
        # dynamic miniters (which, after a burst of finished requests, can hold back the next redraws).
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm,
                   miniters=1, mininterval=0)
        out_tokens = 0
        next_draw = time.monotonic() + BAR_REFRESH_S

        def draw() -> None:
            elapsed = bar.format_dict["elapsed"] or 1e-9
            bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
            bar.update(len(finished) - bar.n)

        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if use_tqdm:
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                if use_tqdm and len(finished) > bar.n and time.monotonic() >= next_draw:
                    draw()
                    next_draw = time.monotonic() + BAR_REFRESH_S
            if use_tqdm and len(finished) > bar.n:
                draw()  # the final count and rate, whatever the interval
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
    """Token ids of a conversation rendered with ``chat_template`` or the tokenizer's own
    (``render_chat``'s text, tokenized without adding special tokens)."""
    text = render_chat(tokenizer, messages, chat_template, add_generation_prompt, continue_final_message,
                       chat_template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(tokenizer, messages: Messages, chat_template: Optional[str] = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Optional[dict] = None) -> str:
    """The text of a conversation rendered with ``chat_template`` or the tokenizer's own.

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
    return tokenizer.apply_chat_template(norm, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **kwargs)


def _settings_doc() -> str:
    """The "Settings" section of LLM's docstring: each EngineArgs field, its default and help."""
    lines = ["", "    Settings (the EngineArgs fields; the CLI's flag in brackets):"]
    for f in dataclasses.fields(EngineArgs):
        flag = f.name.upper() if f.metadata["positional"] else cli_flag(f.name)
        lines.append(textwrap.fill(f"{f.name} = {f.default!r} [{flag}]: {f.metadata['help']}", width=110,
                                   initial_indent=" " * 8, subsequent_indent=" " * 12, break_on_hyphens=False))
    return "\n".join(lines) + "\n"


LLM.__doc__ = (LLM.__doc__ or "") + _settings_doc()

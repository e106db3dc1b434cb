"""The synchronous engine: add requests, call ``step()`` until done.

One step = schedule -> build the flat batch -> forward -> sample -> update requests ->
detokenize -> RequestOutputs for every request that advanced or finished.

With pipeline parallelism (the executor's ``max_concurrent_batches`` P > 1) a step first fills
the pipeline (schedule and submit batches until P are in flight or nothing is left to schedule),
then waits for the oldest batch's logits and processes them as above (vLLM V1's
``step_with_batch_queue``).
"""
from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections import deque
from typing import Iterable, Optional, Union

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.kv_cache_manager import KVCacheManager, max_blocks_per_seq
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler, SchedulerStats
from pagedllm.layers.sampler import Sampler, SamplingRow, topk_logprobs
from pagedllm.lora.peft import load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LoRASlotTable
from pagedllm.models.checkpoint import load_tokenizer
from pagedllm.multimodal.encoder_cache import EncoderCacheManager, encoder_cache_capacity
from pagedllm.multimodal.inputs import MultiModalInputs
from pagedllm.multimodal.processor import make_mm_processor
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backend import make_compiler
from pagedllm.worker.executor_factory import make_executor
from pagedllm.engine.input_batch import InputBatch
from pagedllm.engine.request import banned_token_ids
from pagedllm.engine.speculator import Speculator, SpecStepPlan, make_draft_proposer

logger = logging.getLogger("pagedllm")

PromptType = Union[str, list[int], dict]


def _generation_eos_ids(model_path: str) -> set[int]:
    try:
        from transformers import GenerationConfig  # lazily: transformers, ~1 s to import

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except Exception:  # noqa: BLE001 - generation_config.json is optional
        return set()
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


class LLMEngine:
    """Raises ValueError at construction for invalid settings, or when not even one
    ``max_model_len`` sequence fits in the KV cache."""

    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.config = config
        mc, cc = config.model_config, config.cache_config
        self.model_config = mc
        self.tokenizer = load_tokenizer(mc.tokenizer)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.generation_eos_ids = _generation_eos_ids(mc.model)
        self.vocab_size = mc.hf_config.vocab_size
        self.executor = make_executor(config)
        # Speculative decoding's draft model or MTP layer, loaded before the KV budget is set (its cache shares it).
        try:
            self.draft = make_draft_proposer(config, self.executor) if config.speculative_config is not None else None
            self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                              cc.sliding_window)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager,
                                   self.executor.max_concurrent_batches)
        # The step's flat batch, kept from step to step (rows updated where sequences join, leave, grow).
        self.input_batch = InputBatch(self.kv_cache_manager, config.scheduler_config.max_num_seqs,
                                      mc.max_model_len, config.device)
        # Pipeline parallelism: (schedule, plan, future) of each batch in flight, oldest first.
        self._inflight: deque = deque()
        self.max_inflight_batches = 0  # the most batches ever in flight at once (0: never pipelined)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler_config.stream_interval)
        self.sampler = Sampler()
        self.grammar_compiler = make_compiler(self.tokenizer, self.vocab_size)
        self.speculator: Optional[Speculator] = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config, self.kv_cache_manager, self.scheduler, self.sampler,
                                         self.eos_token_id, self.draft)
            self.scheduler.use_table = False  # (proposals make rows other than plain decodes)
            logger.info(self.speculator.startup_line())
        self.log_stats = log_stats
        # Offline batches only need each request's final output (saves per-step work).
        self.final_outputs_only = False
        self._counter = itertools.count()
        self._last_log = time.time()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # (the last step's sampling requests list, their SamplingRows, whether all are plain greedy):
        # kept while the input batch hands out the same list and every row is its request's kept one
        self._rows_cache: Optional[tuple[list[Request], list[SamplingRow], bool]] = None
        # The pooling runner: a request ends with its prompt, its output is the embedding (``pooled``).
        self.pooling = mc.runner == "pooling"
        # LoRA (--enable-lora): the slot table of the batch builder, and the adapters checked so far
        # (id -> the request that named it first): an adapter is read and checked once, here, so a bad
        # one fails its request (400) instead of a step.
        lc = config.lora_config
        self.lora_slots = LoRASlotTable(lc.max_loras) if lc is not None else None
        self.input_batch.lora_slots = self.lora_slots
        if self.speculator is not None:  # its verification batches carry each token's adapter slot too
            self.speculator.lora_slots = self.lora_slots
        self.checked_loras: dict[int, LoRARequest] = {}
        # Image input (an image-text model): prompts' images processed here, encoded by the runner, whose
        # encoder cache the batch builder keeps track of.
        self.mm_processor = make_mm_processor(config)
        if self.mm_processor is not None:
            self.input_batch.encoder_cache = EncoderCacheManager(encoder_cache_capacity(config))
            self.input_batch.mm_bidirectional = self.mm_processor.tower_cls.bidirectional_image_attention
            if self.speculator is not None:  # its verification batches carry prompt chunks' images too
                self.speculator.encoder_cache = self.input_batch.encoder_cache
                self.speculator.mm_bidirectional = self.input_batch.mm_bidirectional

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool = False) -> "LLMEngine":
        return cls(args.create_engine_config(), log_stats=log_stats)

    # ---- start-up ------------------------------------------------------------------------
    def _init_kv_cache(self) -> None:
        mc, cc, sc = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        budget, how = self.executor.determine_kv_budget()
        per_block = self.executor.bytes_per_block()
        if self.draft is not None:  # the draft's (MTP layer's) cache has as many blocks, from the same budget
            per_block += self.draft.bytes_per_block()
        num_blocks = budget // per_block if budget > 0 else 0
        windows = self.executor.sliding_windows()
        # One window on every layer, shorter than a sequence: blocks behind it can be freed (with a
        # null block reserved), unless the pool holds a whole sequence but not that much.
        if windows[0] is not None and windows[0] < mc.max_model_len and windows.count(windows[0]) == len(windows):
            windowed = max_blocks_per_seq(mc.max_model_len, cc.block_size, windows[0], sc.max_num_batched_tokens)
            whole = max_blocks_per_seq(mc.max_model_len, cc.block_size)
            if num_blocks >= windowed + 1 or num_blocks < whole:
                cc.sliding_window = windows[0]
        blocks_per_seq = max_blocks_per_seq(mc.max_model_len, cc.block_size, cc.sliding_window,
                                            sc.max_num_batched_tokens)
        reserved = int(cc.sliding_window is not None)  # the null block (block 0), never handed out
        if self.config.device == "cpu" and cc.kv_cache_memory is None:
            num_blocks = min(num_blocks, sc.max_num_seqs * blocks_per_seq + reserved)
        if num_blocks < blocks_per_seq + reserved:
            # gpu_memory_utilization is the knob on a GPU; on a CPU give the cache bytes directly
            window = (f" (sliding window {cc.sliding_window}, one step of {sc.max_num_batched_tokens} tokens and "
                      f"the null block)" if reserved else "")
            raise_what = ("gpu_memory_utilization or kv_cache_memory" if self.config.device.startswith("cuda")
                          else "kv_cache_memory")
            raise ValueError(
                f"the KV cache ({max(budget, 0) / 2**20:.1f} MiB from {how}) holds {num_blocks} blocks of "
                f"{cc.block_size} tokens, fewer than the {blocks_per_seq + reserved} one sequence of max_model_len="
                f"{mc.max_model_len} needs{window}; raise {raise_what}, or lower max_model_len")
        cc.num_blocks = num_blocks
        self.executor.allocate_kv_cache(num_blocks)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)
        kv_bytes = num_blocks * per_block * self.config.parallel_config.world_size
        pc = self.config.parallel_config
        capped = (f" capped at max_num_seqs x {blocks_per_seq} blocks a sequence" if num_blocks < budget // per_block
                  else "")
        threads = f" | threads {pc.num_threads} ({pc.num_threads_reason})" if pc.num_threads else ""
        logger.info(
            "model=%s arch=%s dtype=%s (%s) device=%s tp=%d pp=%d | KV cache%s: %d blocks x %d tokens = %.1f MiB "
            "(%s%s) | max concurrency at max_model_len=%d: %.2f sequences%s | weights %.1f MiB%s | "
            "prefix caching %s%s",
            mc.model, mc.architecture + ((f" (the text model of {text_of}; images in with its vision tower)"
                                          if mc.is_multimodal else f" (the text model of {text_of}; images are "
                                                                   f"not supported)")
                                         if (text_of := getattr(mc.hf_config, "text_only_of", None)) else "")
            + (" runner=pooling (embeddings)" if mc.runner == "pooling" else ""),
            str(mc.dtype).replace("torch.", ""), mc.dtype_reason or "given",
            self.config.device, pc.tensor_parallel_size, pc.pipeline_parallel_size,
            " (int8)" if cc.cache_dtype == "int8" else "", num_blocks, cc.block_size, kv_bytes / 2**20, how, capped,
            mc.max_model_len, (num_blocks - reserved) / blocks_per_seq,
            f" (sliding window {cc.sliding_window} on every layer: blocks behind it are freed)" if reserved else "",
            self.executor.weight_bytes() / 2**20,
            f" ({mc.quantization})" if mc.quantization else "",
            "on" if cc.enable_prefix_caching else "off", threads)

    # ---- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, token ids). Raises ValueError on an empty or invalid prompt."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs a 'prompt' or 'prompt_token_ids' key, got {list(prompt)}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: Optional[str] = prompt
        elif not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        else:
            ids, text = list(prompt), None
            if any(type(t) is not int or t < 0 or t >= self.vocab_size for t in ids):  # (not bool)
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        return text, ids

    def preprocess_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int], Optional[MultiModalInputs]]:
        """(prompt text or None, token ids, its images processed or None). A prompt dict may carry
        images as vLLM takes them, ``{"prompt": text, "multi_modal_data": {"image": PIL image or list}}``
        (the text holds one placeholder per image, or none: they go first), or already processed
        (``{"mm_inputs": MultiModalInputs}``, from the API server's front end). ``"add_special_tokens":
        False`` in the dict: the text is a rendered chat (its template wrote the special tokens).

        Raises:
            ValueError: what ``tokenize_prompt`` raises; images for a text-only model, more images than
                --limit-mm-per-prompt, an image that cannot be used (a MediaError) or whose tokens do not
                fit one step (max_num_batched_tokens).
        """
        if not isinstance(prompt, dict) or not ("multi_modal_data" in prompt or "mm_inputs" in prompt):
            return (*self.tokenize_prompt(prompt), None)
        mm = prompt.get("mm_inputs")
        text = prompt.get("prompt")
        if mm is None:
            data = prompt["multi_modal_data"] or {}
            if not isinstance(data, dict) or set(data) - {"image"}:
                got = list(data) if isinstance(data, dict) else type(data).__name__
                raise ValueError(f"multi_modal_data takes 'image' only, got {got}")
            images = data.get("image")
            images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
            if not images:
                return (*self.tokenize_prompt({k: v for k, v in prompt.items() if k != "multi_modal_data"}), None)
            if self.mm_processor is None:
                raise ValueError(f"{self.model_config.architecture} is a text-only model: it takes no images")
            if not isinstance(text, str):
                raise ValueError("a prompt with images needs its text under 'prompt' (token ids cannot be expanded)")
            mm = self.mm_processor.process(text, images, bool(prompt.get("add_special_tokens", True)))
        if self.mm_processor is None:
            raise ValueError(f"{self.model_config.architecture} is a text-only model: it takes no images")
        budget = self.config.scheduler_config.max_num_batched_tokens
        for i, f in enumerate(mm.features):
            if f.length > budget:
                raise ValueError(f"image {i} takes {f.length} tokens, more than max_num_batched_tokens={budget} "
                                 f"(an image's tokens are computed in one step)")
        return text, list(mm.prompt_token_ids), mm

    def add_request(self, request_id: Optional[str], prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    lora_request: Optional[LoRARequest] = None) -> str:
        """Queue a request. Returns its id. ``priority``: under the priority scheduling policy, lower
        runs first (vLLM's convention). ``lora_request``: the LoRA adapter it runs with (``add_lora``
        checks it on first use). Raises ValueError when the prompt is empty, longer than
        max_model_len, or has ids outside the vocabulary, or for a priority under the FCFS policy,
        or for an adapter that cannot be served."""
        self.check_priority(priority)
        if lora_request is not None:
            self.add_lora(lora_request)
        priority = int(priority)  # (a NumPy integer too)
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._counter))
        text, ids, mm = self.preprocess_prompt(prompt)
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={max_len}")
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        if params.n > max_num_seqs:  # its samples could never run together
            raise ValueError(f"n={params.n} is more than max_num_seqs={max_num_seqs} sequences can run at once")
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id in self.scheduler.requests or f"{request_id}#0" in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is still in use: it was aborted while its batch was "
                             f"in flight (pipeline parallelism); use another id")
        self.verify_logits_fields(params)
        if self.pooling and (params.n != 1 or params.logprobs is not None or params.prompt_logprobs is not None
                             or params.structured_outputs is not None):
            raise ValueError("the pooling runner embeds prompts: n, logprobs, prompt_logprobs and structured "
                             "outputs do not apply")
        max_tokens = max_len - len(ids) if params.max_tokens is None else params.max_tokens
        arrival_time = arrival_time or time.time()
        children = []
        for i in range(params.n):
            sp = params.clone()
            if params.n > 1 and params.seed is not None:
                sp.seed = params.seed + i
            sp.all_stop_token_ids = set(self.generation_eos_ids)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, ids, sp, self.eos_token_id, arrival_time, max(1, max_tokens),
                            parent_id=request_id, index=i, device=self.config.device, priority=priority,
                            lora_request=lora_request, mm_inputs=mm)
            if sp.structured_outputs is not None:  # each sample follows its own grammar state
                child.grammar = self.grammar_compiler.matcher(sp.structured_outputs)
            children.append(child)
        self.output_processor.add_request(request_id, text, ids, children)
        self.scheduler.add_request(children[0], forks=children[1:])
        return request_id

    # ---- LoRA adapters -------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter (rank, targets, shapes against the model) once per id; True.

        Raises:
            ValueError: LoRA is off, the id is taken by another adapter, or the adapter cannot be
                served (``LoRAFormatError`` naming why).
        """
        lc = self.config.lora_config
        if lc is None:
            raise ValueError("LoRA adapters need enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        seen = self.checked_loras.get(lora_request.lora_int_id)
        if seen is not None:
            if seen.lora_name != lora_request.lora_name or seen.lora_path != lora_request.lora_path:
                raise ValueError(f"LoRA id {lora_request.lora_int_id} is already adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); give each adapter its own id")
            return True
        load_peft_adapter(lora_request.lora_path, lc.max_lora_rank, self.model_config.hf_config)
        self.checked_loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests in flight with it finish with it: their slot is only reused
        once no running request names it). Returns whether it was known."""
        known = self.checked_loras.pop(lora_int_id, None) is not None
        if known and self.lora_slots is not None and not any(
                r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
                for r in self.scheduler.requests.values()):
            self.lora_slots.forget(lora_int_id)
        return known

    def list_loras(self) -> set[int]:
        return set(self.checked_loras)

    def check_priority(self, priority: int) -> None:
        """ValueError for a non-integer priority (booleans included), or a non-zero one under FCFS."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(f"priority={priority} needs the priority scheduling policy (--scheduling-policy "
                             f"priority); requests are served first come, first served")

    def verify_logits_fields(self, params: SamplingParams) -> None:
        """Check logprobs against max_logprobs and token ids against the vocabulary, tokenize
        ``bad_words``, compile the grammar (cached). Raises ValueError saying what is wrong (the
        server answers 400)."""
        limit = self.model_config.max_logprobs
        name = params.logprobs_above(limit)
        if name:
            raise ValueError(f"{name}={getattr(params, name)} is more than max_logprobs={limit}")
        why = params.token_ids_out_of_vocab(self.vocab_size)
        if why:
            raise ValueError(why)
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured outputs need a fast (Rust) Hugging Face tokenizer")
            self.grammar_compiler.compile(params.structured_outputs)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Token ids of each bad word, alone and after a space (as vLLM bans both spellings)."""
        out: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """Abort requests (by the id given to add_request); their blocks are freed now. Returns
        their final outputs (``finished``, finish_reason "abort" on every unfinished sample)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for rid in request_ids:
            state = self.output_processor.states.get(rid)
            if state is not None:
                self.scheduler.finish_requests([c.request_id for c in state.children], RequestStatus.FINISHED_ABORTED)
                out = self.output_processor.make_output(rid)  # also drops the state
                if out is not None:
                    finals.append(out)
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    @property
    def pipeline_depth(self) -> int:
        """How many batches may be in flight at once: the pipeline-parallel size by default;
        1 runs each batch through every stage before the next (synchronous)."""
        return self.scheduler.pipeline_depth

    @pipeline_depth.setter
    def pipeline_depth(self, depth: int) -> None:
        if not 1 <= depth <= self.executor.max_concurrent_batches:
            raise ValueError(f"pipeline_depth must be in [1, {self.executor.max_concurrent_batches}], got {depth}")
        if self._inflight:
            raise RuntimeError("cannot change pipeline_depth while batches are in flight")
        self.scheduler.pipeline_depth = depth

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        enc = self.input_batch.encoder_cache
        if enc is not None:
            stats.mm_cache_queries, stats.mm_cache_hits = enc.queries, enc.hits
        return stats

    # ---- one step ------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise RuntimeError if the model workers are gone (a tensor-parallel rank died)."""
        self.executor.check_health()

    def step(self) -> list[RequestOutput]:
        """Raises RuntimeError when a tensor-parallel worker died (even with nothing scheduled)."""
        self.executor.check_health()
        if self.scheduler.pipeline_depth > 1:
            return self._step_pipelined()
        if self.speculator is not None:
            self.speculator.propose()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        plan = None
        if self.speculator is not None:  # a batch verifying proposals (None: no sequence has any)
            plan = self.speculator.prepare_inputs(sched_out, self.scheduler.forks)
            if plan is not None:
                # Tokens accepted several at a time and rolled-back blocks: the persistent rows are
                # read again from their requests at the next plain step.
                self.input_batch.invalidate()
        if plan is None:
            plan = self.input_batch.prepare(sched_out, self.scheduler.forks)
        logits = self.executor.execute_model(plan.model_input)
        if plan.model_input.return_hidden:  # mtp: the target's hidden states, the MTP layer's next input
            logits, plan.hidden = logits
        return self._process_output(sched_out, plan, logits)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Submit batches until ``pipeline_depth`` are in flight (or none is left to schedule),
        then process the oldest one's output."""
        while len(self._inflight) < self.scheduler.pipeline_depth:
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                break
            plan = self.input_batch.prepare(sched_out, self.scheduler.forks)
            self._inflight.append((sched_out, plan, self.executor.execute_model_async(plan.model_input)))
            self.max_inflight_batches = max(self.max_inflight_batches, len(self._inflight))
        if not self._inflight:
            return []
        sched_out, plan, future = self._inflight.popleft()
        return self._process_output(sched_out, plan, future.result())

    def _process_output(self, sched_out, plan, logits: torch.Tensor) -> list[RequestOutput]:
        """Sample, update the requests of one batch and make their outputs."""
        num_sample = len(plan.sampling_requests)
        sampled: dict[str, int] = {}
        token_ids = token_array = None
        num_table = 0  # leading sampling requests that are the request table's rows (no dict entry)
        if self.pooling:  # rows are embeddings: no token is sampled and the requests end (scheduler)
            rows = logits[:num_sample].cpu()
            for i, r in enumerate(plan.sampling_requests):
                r.pooled = rows[i]
        elif num_sample:
            reqs = plan.sampling_requests
            rows, plain = self._sampling_rows(reqs)
            out = self.sampler(logits if len(logits) == num_sample else logits[:num_sample], rows,
                               all_plain_greedy=plain)
            token_ids = out.token_ids
            tokens = out.token_tensor  # (int64 [num_sample]: once, for the batch and the table)
            token_array = (tokens.numpy() if tokens is not None and tokens.device.type == "cpu"
                           else np.fromiter(token_ids, np.int64, num_sample))
            if not isinstance(plan, SpecStepPlan):
                self.input_batch.record_sampled(plan, token_array)
                if sched_out.table_rows is not None and sched_out.table_rows is self.scheduler.table.rows:
                    num_table = len(sched_out.table_rows)  # (update_from_output advances them from token_ids)
            sampled = (dict(zip([r.request_id for r in reqs[num_table:]], token_ids[num_table:]))
                       if num_table < num_sample else {})
            if not plain:  # (plain rows: no grammar, no logprobs)
                for r, tok, lp in zip(reqs, token_ids, out.logprobs):
                    if r.grammar is not None:
                        r.grammar.accept(tok)
                    if lp is not None:
                        r.logprobs.append(self.output_processor.make_logprobs(lp, tok))
                        r.cumulative_logprob += lp[0]
        if plan.prompt_logprob_spans:
            self._collect_prompt_logprobs(plan, logits[num_sample:])
        if isinstance(plan, SpecStepPlan):  # sequences verifying proposals: their tokens, their rollback
            sched_out, spec_sampled, appended = self.speculator.verify(plan, logits, sched_out,
                                                                       self.output_processor.make_logprobs)
            sampled.update(spec_sampled)
            self.num_generation_tokens_total += appended

        # A request's whole prompt (prefix-cache hits included) once, in the step its prefill
        # completes, as vLLM counts prompt tokens: not again after a preemption, nor per n > 1 sample.
        # (Only the step's fresh rows can: a row that advanced in place had its first token already.)
        self.num_prompt_tokens_total += sum(
            r.num_prompt_tokens for r, n in plan.fresh
            if r.metrics.first_token_time is None and r.num_computed_tokens + n >= r.num_prompt_tokens)
        updated = self.scheduler.update_from_output(sched_out, sampled, token_ids, token_array)
        self.num_generation_tokens_total += len(sampled) + num_table
        # Offline final outputs: requests without stop strings are detokenized once they finish (one
        # token a sample a step is what makes that exact: not with speculative decoding).
        stopped = self.output_processor.process(updated, self.final_outputs_only and self.speculator is None)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self.speculator is not None:
            self.speculator.release_finished()
        outputs = []
        op = self.output_processor
        make_output = op.make_output
        # Only requests with a sequence that finished this step can be finished (so only those are
        # looked at when only final outputs are wanted).
        if self.final_outputs_only:
            # (what update_from_output finished, unless stop strings finished more)
            done = self.scheduler.last_finished if not stopped else [r for r in updated if r.status.finished]
            for parent_id in dict.fromkeys(r.parent_id for r in done):
                if op.is_finished(parent_id):
                    out_ = make_output(parent_id)
                    if out_ is not None:
                        outputs.append(out_)
        else:
            due = op.output_due if op.stream_interval > 1 else None  # --stream-interval
            for parent_id in dict.fromkeys(r.parent_id for r in updated):
                if due is not None and not due(parent_id):
                    continue
                out_ = make_output(parent_id)
                if out_ is not None:
                    outputs.append(out_)
        if self.log_stats and time.time() - self._last_log > 10.0:
            self._log_stats()
        return outputs

    def _sampling_rows(self, reqs: list[Request]) -> tuple[list[SamplingRow], bool]:
        """(the SamplingRow of each request of ``reqs``, whether all are plain greedy). The same list
        object as last step (the input batch hands out the request table's rows while they stay) with
        every row its request's kept one (``Request.sampling_row``, never changed once set) gives the
        same rows: they are kept with it."""
        cache = self._rows_cache
        if cache is not None and cache[0] is reqs:
            return cache[1], cache[2]
        rows = [r.sampling_row or self._sampling_row(r) for r in reqs]
        plain = all(row.plain_greedy for row in rows)
        self._rows_cache = (reqs, rows, plain) if all(r.sampling_row is not None for r in reqs) else None
        return rows, plain

    def _sampling_row(self, r: Request) -> SamplingRow:
        """The sampler's view of ``r``; kept on the request (``r.sampling_row``) once nothing in it
        changes from step to step (past ``min_tokens``: no banned ids; its token lists are the
        request's own, which grow in place)."""
        banned = None if len(r.output_token_ids) >= r.sampling_params.min_tokens else self._banned_token_ids(r)
        row = SamplingRow(r.sampling_params, r.generator, r.prompt_token_ids, r.output_token_ids, banned, r.grammar)
        if banned is None:
            r.sampling_row = row
        return row

    def _banned_token_ids(self, req: Request) -> Optional[list[int]]:
        """Before ``min_tokens`` outputs, EOS and stop token ids cannot be sampled (as in vLLM)."""
        return banned_token_ids(req.sampling_params, req.num_output_tokens, self.eos_token_id)

    def _collect_prompt_logprobs(self, plan, logits: torch.Tensor) -> None:
        logprobs = logits.log_softmax(dim=-1)
        row = 0
        for req, first_pos, count in plan.prompt_logprob_spans:
            k = req.sampling_params.prompt_logprobs
            for j in range(count):
                tok = req.prompt_token_ids[first_pos + j]
                lp = topk_logprobs(logprobs[row + j], tok, k)
                req.prompt_logprobs.append(self.output_processor.make_logprobs(lp, tok))
            row += count

    def _log_stats(self) -> None:
        s = self.get_stats()
        self._last_log = time.time()
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        spec = ""
        if self.speculator is not None and self.speculator.stats.num_draft_tokens:
            st = self.speculator.stats
            spec = (f" spec_decode: acceptance {100 * st.num_accepted_tokens / st.num_draft_tokens:.1f}%, mean "
                    f"acceptance length {st.mean_acceptance_length:.2f}")
        logger.info("running=%d waiting=%d kv_usage=%.1f%% preemptions=%d prefix_cache_hit_rate=%.1f%%%s",
                    s.num_running, s.num_waiting, 100 * s.kv_cache_usage, s.num_preemptions, 100 * hit, spec)

    def shutdown(self) -> None:
        # Let batches in flight come back first, so no rank is left mid-transfer (a failed
        # executor answers at once).
        while self._inflight:
            try:
                self._inflight.popleft()[2].result()
            except Exception:  # noqa: BLE001 - the executor is failed; nothing left to wait for
                self._inflight.clear()
        self.executor.shutdown()


__all__ = ["LLMEngine", "Logprob"]

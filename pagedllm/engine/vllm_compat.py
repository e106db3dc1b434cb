"""Why does ``pagedllm serve`` accept ``--swap-space 4``? A launch line copied from a vLLM deployment starts here.

Every ``vllm serve`` flag (tests/data/vllm_serve_flags.txt lists vLLM's) is one of:

- a pagedllm flag under vLLM's name (``--max-model-len``, ``--api-key``, ...): an ``EngineArgs`` /
  ``ServerArgs`` field, applied; it is not in this module;
- in ``VLLM_FLAGS`` below, the one table of the rest. Each entry says how the flag parses (its kind) and
  either why it has no effect here (a feature pagedllm lacks whose absence does not change what a request
  returns: logging, GPU-only tuning, schedulers, LoRA tuning) or, with ``refuse``, the values that would
  change results (``--rope-scaling``, ``--ssl-keyfile``): those stop start-up with a
  message naming the flag. A few are applied through ``apply`` (``--model X`` is the MODEL argument,
  ``--task embed`` is ``--runner pooling``, ``--disable-uvicorn-access-log`` is ``--disable-access-log``,
  ``--kv-cache-memory-bytes 2G`` is ``--kv-cache-memory``).

``--trust-remote-code`` is accepted with no effect: pagedllm runs only its own model implementations. A model
pagedllm implements needs no remote code (its own code runs, flag or not); a local model whose config.json
needs remote code (``auto_map``) for an architecture pagedllm lacks is refused at once with that reason
(a hub id: the config load says so later), as it would be without the flag.

``add_vllm_args`` adds the table's flags to a parser (skipping any the parser already has, e.g. a field
added later under vLLM's name), plus ``--no-X`` for pagedllm's own store-true flags, as vLLM's booleans
take. ``normalize_argv`` rewrites vLLM's argv forms argparse cannot read: ``--config FILE.yaml`` (the
file's options, before the command line's) and the dotted JSON forms ``--structured-outputs-config.backend
xgrammar`` / ``--x.y=v`` / ``--x.list+ v``. ``check`` runs at start-up: applies, refuses (ValueError), and
returns the one warning line naming the no-effect flags given.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pagedllm.models.registry import supported_architectures

DEST_PREFIX = "vllm_compat__"  # the namespace attribute of a table flag: only present when the flag was given
KINDS = ("bool", "flag", "value", "optvalue", "values")  # --x/--no-x, store_true, one value, optional, 1+


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag pagedllm has no field for.

    kind: how it parses (``KINDS``). why: the start-up warning's reason it has no effect here, or (with
    ``refuse``) why it would change results. refuse: the given value -> True when pagedllm must refuse it
    (a bool flag's value is True/False; a value flag's is the list of its values as given, str).
    apply: sets the pagedllm option it stands for (then no warning, unless it returns a note naming a part with
    no effect). json: a JSON config (takes dotted forms).
    aliases: vLLM's short forms (``-O3`` for ``--compilation-config 3``). validate: (args, value) -> None or
    ValueError, for a refusal that depends on more than the value (``--trust-remote-code``: the model).
    """
    kind: str
    why: str
    refuse: Optional[Callable[[Any], bool]] = None
    apply: Optional[Callable[[argparse.Namespace, Any], None]] = None
    json: bool = False
    aliases: tuple[str, ...] = ()
    validate: Optional[Callable[[argparse.Namespace, Any], None]] = None  # raises ValueError (a no-effect flag)


def _always(value: Any) -> bool:
    return True


def _set(value: Any) -> bool:
    """Refuse a bool flag turned on (its off value is pagedllm's behaviour)."""
    return value is True


def _unless(*ok: str) -> Callable[[Any], bool]:
    """Refuse any value but ``ok`` (compared lower-case)."""
    return lambda values: any(str(v).lower() not in ok for v in values)


def _json_keys_true(*keys: str) -> Callable[[Any], bool]:
    """Refuse a JSON config setting one of ``keys`` to true (in JSON or a dotted ``key=true`` form)."""
    def refuse(values: Sequence[str]) -> bool:
        for v in values:
            try:
                obj = json.loads(v)
            except ValueError:
                obj = dict([v.split("=", 1)]) if "=" in v else {}
            if isinstance(obj, dict) and any(str(obj.get(k, "")).lower() == "true" for k in keys):
                return True
        return False
    return refuse


def _remote_code_model(args: argparse.Namespace, value: bool) -> None:
    """--trust-remote-code for a local model that needs remote code pagedllm does not run: ValueError."""
    path = os.path.join(args.model or "", "config.json")
    if not value or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # the config load at start-up reports it
    archs = config.get("architectures") or []
    missing = [a for a in archs if a not in supported_architectures()]
    if config.get("auto_map") and missing:
        raise ValueError(f"--trust-remote-code: {args.model} needs its own model code (auto_map) for "
                         f"{', '.join(missing)}, and pagedllm runs only its own implementations, which do not "
                         f"include it (supported: {', '.join(supported_architectures())})")


def _apply_model(args: argparse.Namespace, values: Sequence[str]) -> None:
    if args.model is not None and args.model != values[-1]:
        raise ValueError(f"the model is given twice: MODEL {args.model!r} and --model {values[-1]!r}")
    args.model = values[-1]


def _apply_task(args: argparse.Namespace, values: Sequence[str]) -> None:
    if values[-1] in ("embed", "embedding"):
        args.runner = "pooling"


def _apply_access_log(args: argparse.Namespace, value: bool) -> None:
    args.disable_access_log = args.disable_access_log or value


def vllm_int(value: str) -> int:
    """vLLM's human-readable integer: '25.6k' = 25600 (k, m, g, t: powers of 1000), '2G' = 2 GiB (K, M, G, T:
    powers of 1024), '1073741824'.

    Raises:
        ValueError: not such a number.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)\s*", value)
    if not m:
        raise ValueError(f"--kv-cache-memory-bytes: not a number of bytes: {value!r} (e.g. 2G, 512M, 1073741824)")
    unit = m.group(2)
    scale = 1 if not unit else (1000 if unit.islower() else 1024) ** ("kmgt".index(unit.lower()) + 1)
    return int(float(m.group(1)) * scale)


def _apply_kv_cache_bytes(args: argparse.Namespace, values: Sequence[str]) -> None:
    n = vllm_int(values[-1])
    if args.kv_cache_memory is not None and args.kv_cache_memory != n:
        raise ValueError(f"--kv-cache-memory {args.kv_cache_memory} and --kv-cache-memory-bytes {values[-1]} disagree")
    args.kv_cache_memory = n


def _apply_hf_token(args: argparse.Namespace, values: Sequence[str]) -> None:
    if values[-1]:  # --hf-token alone: huggingface_hub's cached login, as vLLM
        os.environ["HF_TOKEN"] = values[-1]


def _json_config(values: Sequence[str]) -> dict:
    """A JSON config flag's values (JSON objects or dotted ``key=value`` forms) as one dict."""
    out: dict = {}
    for v in values:
        try:
            obj = json.loads(v)
        except ValueError:
            obj = dict([v.split("=", 1)]) if "=" in v else {}
        if isinstance(obj, dict):
            out.update(obj)
    return out


def _set_additional_properties(args: argparse.Namespace, backend: Optional[str] = None,
                               disable: Optional[bool] = None) -> None:
    """vLLM's rule for JSON schemas' undeclared properties from its backend and
    disable_additional_properties: only guidance without disable_additional_properties allows them."""
    if backend is not None:
        args.vllm_so_backend = backend.lower()
    if disable is not None:
        args.vllm_so_disable = disable
    guidance = getattr(args, "vllm_so_backend", "auto").startswith("guidance")
    args.json_additional_properties = "allow" if guidance and not getattr(args, "vllm_so_disable", False) \
        else "forbid"


def _apply_so_backend(args: argparse.Namespace, values: Sequence[str]) -> None:
    _set_additional_properties(args, backend=values[-1])


def _apply_so_disable_additional(args: argparse.Namespace, value: bool) -> None:
    _set_additional_properties(args, disable=bool(value))


def _apply_so_config(args: argparse.Namespace, values: Sequence[str]) -> Optional[str]:
    """backend and disable_additional_properties are applied; any other key has no effect (its note)."""
    config = _json_config(values)
    disable = config.get("disable_additional_properties")
    _set_additional_properties(args, backend=config.get("backend"),
                               disable=None if disable is None else str(disable).lower() == "true")
    rest = sorted(set(config) - {"backend", "disable_additional_properties"})
    return f"{', '.join(rest)}: {_SO}" if rest else None


_LOG = "logging only"
_GPU = "GPU-only tuning (CUDA graphs, kernels, compilation); no effect on outputs"
_MM = "not for the image-text models served here (images: --limit-mm-per-prompt, --allowed-local-media-path)"
_LORA = "LoRA tuning pagedllm does not need (adapters are served with --enable-lora / --lora-modules)"
_DP = "multi-node data parallelism is not supported; --data-parallel-size replicas are local processes"
_EP = "expert placement across GPUs; no effect on outputs"
_SCHED = "scheduler tuning; pagedllm's scheduler always chunks prefills and recomputes preempted requests"
_SO = ("structured outputs use pagedllm's own grammar engine (llguidance); the backend choice sets only whether "
       "JSON schemas admit undeclared properties (--json-additional-properties)")
_DISAGG = "no disaggregated prefill/KV transfer; this server computes its own KV cache"
_TRACE = "no OpenTelemetry tracing"
_LOAD = "weight-loading detail; pagedllm loads safetensors / GGUF itself"
_HTTPS = "pagedllm serves plain HTTP only (put a TLS proxy in front)"

# The one table: vLLM's flag -> how it parses and what pagedllm does with it.
VLLM_FLAGS: dict[str, VllmFlag] = {
    # --- frontend / server ---
    "--api-server-count": VllmFlag("value", "one API server process here", aliases=("-asc",)),
    "--uvicorn-log-level": VllmFlag("value", "uvicorn logs at --log-level here"),
    "--disable-uvicorn-access-log": VllmFlag("bool", "", apply=_apply_access_log),
    "--uds": VllmFlag("value", "pagedllm listens on TCP only (--host/--port)", refuse=_always),
    "--chat-template-content-format": VllmFlag(
        "value", "text-only messages: the template gets the content pagedllm renders for it"),
    "--response-role": VllmFlag("value", "the assistant message's role is always 'assistant' here",
                                refuse=_unless("assistant")),
    "--ssl-keyfile": VllmFlag("value", _HTTPS, refuse=_always),
    "--ssl-certfile": VllmFlag("value", _HTTPS, refuse=_always),
    "--ssl-ca-certs": VllmFlag("value", _HTTPS, refuse=_always),
    "--enable-ssl-refresh": VllmFlag("bool", _HTTPS, refuse=_set),
    "--ssl-cert-reqs": VllmFlag("value", _HTTPS, refuse=_always),
    "--root-path": VllmFlag("value", "routes are served at /; a proxy's prefix does not change the API"),
    "--middleware": VllmFlag("values", "pagedllm loads no ASGI middleware", refuse=_always),
    "--return-tokens-as-token-ids": VllmFlag("bool", "logprobs name tokens by their text here", refuse=_set),
    "--disable-frontend-multiprocessing": VllmFlag("bool", "the engine runs in the server's process here"),
    "--enable-request-id-headers": VllmFlag("bool", "no X-Request-Id response header"),
    "--tool-parser-plugin": VllmFlag("value", "no parser plugins; --tool-call-parser names a built-in parser"),
    "--log-config-file": VllmFlag("value", _LOG),
    "--max-log-len": VllmFlag("value", _LOG),
    "--disable-fastapi-docs": VllmFlag("bool", "docs routes only"),
    "--enable-force-include-usage": VllmFlag("bool", "usage is sent only when stream_options asks",
                                             refuse=_set),
    "--disable-log-stats": VllmFlag("flag", _LOG),
    "--disable-log-requests": VllmFlag("flag", _LOG),
    "--enable-log-requests": VllmFlag("bool", _LOG),
    "--enable-log-outputs": VllmFlag("bool", _LOG),
    "--aggregate-engine-logging": VllmFlag("flag", _LOG),
    "--fail-on-environ-validation": VllmFlag("bool", "vLLM's environment variables are not read here"),
    "--grpc": VllmFlag("flag", "pagedllm serves HTTP only", refuse=_set),
    "--trust-request-chat-template": VllmFlag("bool", "a request's chat_template is still refused (400)"),
    "--default-chat-template-kwargs": VllmFlag("value", "no server-side chat-template defaults (a request's "
                                                        "chat_template_kwargs are applied)", refuse=_always),
    "--exclude-tools-when-tool-choice-none": VllmFlag("bool", "tools stay in the prompt with tool_choice none",
                                                      refuse=_set),
    "--tool-server": VllmFlag("value", "no built-in tool servers", refuse=_always),
    "--enable-per-request-metrics": VllmFlag("bool", "no per-request timings in responses (see /metrics)"),
    "--enable-log-deltas": VllmFlag("bool", _LOG),
    "--log-error-stack": VllmFlag("bool", _LOG),
    "--cohere-is-reasoning-model": VllmFlag("bool", "no Cohere API routes"),
    "--cohere-format": VllmFlag("value", "no Cohere API routes"),
    "--tokens-only": VllmFlag("bool", "the OpenAI routes are always served", refuse=_set),
    "--fingerprint-mode": VllmFlag("value", "system_fingerprint is pagedllm's own"),
    "--fingerprint-value": VllmFlag("value", "system_fingerprint is pagedllm's own"),
    "--disable-access-log-for-endpoints": VllmFlag("value", _LOG + " (--disable-access-log turns it all off)"),
    "--ssl-ciphers": VllmFlag("value", _HTTPS, refuse=_always),
    "--h11-max-header-count": VllmFlag("value", "h11's own header-count limit applies"),
    "--enable-offline-docs": VllmFlag("bool", "docs routes only"),
    "--enable-flash-late-interaction": VllmFlag("bool", _GPU),
    # --- model ---
    "--model": VllmFlag("value", "", apply=_apply_model),
    "--task": VllmFlag("value", "generate and embed only (embed = --runner pooling)",
                       refuse=_unless("auto", "generate", "embed", "embedding"), apply=_apply_task),
    "--tokenizer-mode": VllmFlag("value", "the Hugging Face tokenizer (fast where it has one) only",
                                 refuse=_unless("auto", "slow", "hf")),
    "--trust-remote-code": VllmFlag(
        "bool", "pagedllm runs only its own model implementations; a model needing remote code for an "
                "architecture pagedllm lacks is refused", validate=_remote_code_model),
    "--hf-config-path": VllmFlag("value", "the config is the model folder's config.json", refuse=_always),
    "--revision": VllmFlag("value", "a hub model is fetched at its default branch (download the revision and "
                                    "pass its folder)", refuse=_unless("main", "none")),
    "--code-revision": VllmFlag("value", "no remote model code is run"),
    "--tokenizer-revision": VllmFlag("value", "the tokenizer is fetched with the model",
                                     refuse=_unless("main", "none")),
    "--rope-scaling": VllmFlag("value", "no RoPE override (edit the model's config.json)", refuse=_always,
                               json=True),
    "--rope-theta": VllmFlag("value", "no RoPE override (edit the model's config.json)", refuse=_always),
    "--hf-overrides": VllmFlag("value", "no config overrides (edit the model's config.json)", refuse=_always,
                               json=True),
    "--max-seq-len-to-capture": VllmFlag("value", _GPU),
    "--logprobs-mode": VllmFlag("value", "logprobs are reported as vLLM's default (raw_logprobs) only",
                                refuse=_unless("raw_logprobs")),
    "--disable-sliding-window": VllmFlag("bool", "sliding-window models always use their window",
                                         refuse=_set),
    "--disable-cascade-attn": VllmFlag("bool", _GPU),
    "--skip-tokenizer-init": VllmFlag("bool", "the server always detokenizes", refuse=_set),
    "--enable-prompt-embeds": VllmFlag("bool", "no prompt_embeds inputs (such requests are refused)"),
    "--disable-async-output-proc": VllmFlag("flag", _SCHED),
    "--config-format": VllmFlag("value", "Hugging Face config.json (or GGUF metadata) only",
                                refuse=_unless("auto", "hf")),
    "--hf-token": VllmFlag("optvalue", "", apply=_apply_hf_token),
    "--override-neuron-config": VllmFlag("value", "no Neuron devices", json=True),
    "--override-pooler-config": VllmFlag("value", "the pooler is fixed (last token, L2-normalized)",
                                         refuse=_always, json=True),
    "--pooler-config": VllmFlag("value", "the pooler is fixed (last token, L2-normalized)", refuse=_always,
                                json=True),
    "--logits-processor-pattern": VllmFlag("value", "no custom logits processors (such requests are refused)"),
    "--generation-config": VllmFlag(
        "value", "sampling defaults are the request's (no generation_config.json is read)",
        refuse=lambda values: any(str(v).lower() not in ("auto", "vllm") for v in values)),
    "--override-generation-config": VllmFlag("value", "no server-side sampling defaults", refuse=_always,
                                             json=True),
    "--enable-sleep-mode": VllmFlag("bool", "no /sleep route"),
    "--model-impl": VllmFlag("value", "pagedllm's own model implementations"),
    "--convert": VllmFlag("value", "models run as they are (an embedding model: --runner pooling)",
                          refuse=_unless("auto", "none")),
    "--logits-processors": VllmFlag("values", "no custom logits processors", refuse=_always),
    "--io-processor-plugin": VllmFlag("value", "no IO processor plugins", refuse=_always),
    "--safetensors-load-strategy": VllmFlag("value", _LOAD),
    "--override-attention-dtype": VllmFlag("value", "attention runs in the model's dtype", refuse=_always),
    "--load-format-extra": VllmFlag("value", _LOAD),
    "--download-dir": VllmFlag("value", "hub models go to the Hugging Face cache (HF_HOME)"),
    "--model-loader-extra-config": VllmFlag("value", _LOAD, json=True),
    "--ignore-patterns": VllmFlag("values", _LOAD),
    "--use-tqdm-on-load": VllmFlag("bool", _LOG),
    "--pt-load-map-location": VllmFlag("value", _LOAD),
    # --- structured outputs ---
    "--guided-decoding-backend": VllmFlag("value", _SO, apply=_apply_so_backend),
    "--guided-decoding-disable-fallback": VllmFlag("bool", _SO),
    "--guided-decoding-disable-any-whitespace": VllmFlag(
        "bool", "structured outputs allow JSON whitespace here", refuse=_set),
    "--guided-decoding-disable-additional-properties": VllmFlag("bool", _SO, apply=_apply_so_disable_additional),
    "--structured-outputs-config": VllmFlag("value", _SO, refuse=_json_keys_true("disable_any_whitespace"),
                                            json=True, apply=_apply_so_config),
    "--reasoning-config": VllmFlag("value", "reasoning is split by --reasoning-parser here", json=True),
    # --- parallelism ---
    "--data-parallel-rank": VllmFlag("value", _DP, aliases=("-dpn",)),
    "--data-parallel-start-rank": VllmFlag("value", _DP, aliases=("-dpr",)),
    "--data-parallel-size-local": VllmFlag("value", _DP, aliases=("-dpl",)),
    "--data-parallel-address": VllmFlag("value", _DP, aliases=("-dpa",)),
    "--data-parallel-rpc-port": VllmFlag("value", _DP, aliases=("-dpp",)),
    "--data-parallel-backend": VllmFlag("value", _DP, aliases=("-dpb",)),
    "--data-parallel-hybrid-lb": VllmFlag("bool", _DP),
    "--enable-expert-parallel": VllmFlag("bool", _EP),
    "--decode-context-parallel-size": VllmFlag("value", _EP.replace("expert", "KV-cache"), aliases=("-dcp",)),
    "--all2all-backend": VllmFlag("value", _EP),
    "--enable-dbo": VllmFlag("bool", _GPU),
    "--dbo-decode-token-threshold": VllmFlag("value", _GPU),
    "--dbo-prefill-token-threshold": VllmFlag("value", _GPU),
    "--disable-nccl-for-dp-synchronization": VllmFlag("bool", _DP),
    "--expert-placement-strategy": VllmFlag("value", _EP),
    "--data-parallel-supervisor-port": VllmFlag("value", _DP),
    "--dp-supervisor-probe-interval-s": VllmFlag("value", _DP),
    "--dp-supervisor-probe-timeout-s": VllmFlag("value", _DP),
    "--dp-supervisor-probe-failure-threshold": VllmFlag("value", _DP),
    "--enable-eplb": VllmFlag("bool", _EP),
    "--eplb-config": VllmFlag("value", _EP, json=True),
    "--num-redundant-experts": VllmFlag("value", _EP),
    "--eplb-window-size": VllmFlag("value", _EP),
    "--eplb-step-interval": VllmFlag("value", _EP),
    "--eplb-log-balancedness": VllmFlag("bool", _EP),
    "--max-parallel-loading-workers": VllmFlag("value", _LOAD),
    "--ray-workers-use-nsight": VllmFlag("bool", "profiling only"),
    "--disable-custom-all-reduce": VllmFlag("bool", _GPU),
    "--worker-cls": VllmFlag("value", "pagedllm's own workers"),
    "--worker-extension-cls": VllmFlag("value", "pagedllm's own workers"),
    "--enable-multimodal-encoder-data-parallel": VllmFlag("bool", _MM),
    # --- cache ---
    "--swap-space": VllmFlag("value", "no CPU swap space: a preempted request is recomputed"),
    "--num-gpu-blocks-override": VllmFlag("value", "the KV cache is sized by --kv-cache-memory / "
                                                   "--gpu-memory-utilization"),
    "--prefix-caching-hash-algo": VllmFlag("value", "prefix-cache keys are pagedllm's own"),
    "--cpu-offload-gb": VllmFlag("value", "no weight offloading"),
    "--kv-cache-memory-bytes": VllmFlag("value", "", apply=_apply_kv_cache_bytes),
    "--kv-sharing-fast-prefill": VllmFlag("bool", "no models with cross-layer KV sharing here"),
    "--mamba-cache-dtype": VllmFlag("value", "no Mamba models here"),
    "--mamba-ssm-cache-dtype": VllmFlag("value", "no Mamba models here"),
    "--mamba-block-size": VllmFlag("value", "no Mamba models here"),
    "--calculate-kv-scales": VllmFlag("bool", "no fp8 KV cache"),
    # --- multimodal ---
    "--media-io-kwargs": VllmFlag("value", _MM, json=True),
    "--mm-processor-kwargs": VllmFlag("value", _MM, json=True),
    "--disable-mm-preprocessor-cache": VllmFlag("bool", _MM),
    "--interleave-mm-strings": VllmFlag("bool", _MM),
    "--allowed-media-domains": VllmFlag("values", _MM),
    "--enable-mm-embeds": VllmFlag("bool", _MM),
    "--mm-processor-cache-gb": VllmFlag("value", _MM),
    "--mm-processor-cache-type": VllmFlag("value", _MM),
    "--mm-shm-cache-max-object-size-mb": VllmFlag("value", _MM),
    "--mm-encoder-tp-mode": VllmFlag("value", _MM),
    "--mm-encoder-attn-backend": VllmFlag("value", _MM),
    "--skip-mm-profiling": VllmFlag("bool", _MM),
    "--video-pruning-rate": VllmFlag("value", _MM),
    # --- LoRA / prompt adapters ---
    "--enable-lora-bias": VllmFlag("bool", _LORA),
    "--lora-extra-vocab-size": VllmFlag("value", _LORA),
    "--lora-dtype": VllmFlag("value", _LORA),
    "--fully-sharded-loras": VllmFlag("bool", _LORA),
    "--default-mm-loras": VllmFlag("value", _LORA, json=True),
    "--enable-prompt-adapter": VllmFlag("flag", "no prompt adapters (requests naming one are refused)"),
    # --- speculative decoding, observability ---
    "--show-hidden-metrics-for-version": VllmFlag("value", "metrics only"),
    "--otlp-traces-endpoint": VllmFlag("value", _TRACE),
    "--collect-detailed-traces": VllmFlag("values", _TRACE),
    # --- scheduler ---
    "--max-num-partial-prefills": VllmFlag("value", _SCHED),
    "--max-long-partial-prefills": VllmFlag("value", _SCHED),
    "--cuda-graph-sizes": VllmFlag("values", _GPU),
    "--cudagraph-capture-sizes": VllmFlag("values", _GPU),
    "--max-cudagraph-capture-size": VllmFlag("value", _GPU),
    "--long-prefill-token-threshold": VllmFlag("value", _SCHED),
    "--num-lookahead-slots": VllmFlag("value", _SCHED),
    "--scheduler-delay-factor": VllmFlag("value", _SCHED),
    "--preemption-mode": VllmFlag("value", _SCHED),
    "--num-scheduler-steps": VllmFlag("value", _SCHED),
    "--multi-step-stream-outputs": VllmFlag("bool", _SCHED),
    "--enable-chunked-prefill": VllmFlag("bool", _SCHED),
    "--disable-chunked-mm-input": VllmFlag("bool", _MM),
    "--scheduler-cls": VllmFlag("value", _SCHED),
    "--disable-hybrid-kv-cache-manager": VllmFlag("bool", _SCHED),
    "--async-scheduling": VllmFlag("bool", _SCHED),
    # --- KV transfer, compilation, kernels ---
    "--kv-transfer-config": VllmFlag("value", _DISAGG, json=True),
    "--kv-events-config": VllmFlag("value", _DISAGG, json=True),
    "--ec-transfer-config": VllmFlag("value", _DISAGG, json=True),
    "--compilation-config": VllmFlag("value", _GPU, json=True, aliases=("-O",)),
    "--attention-config": VllmFlag("value", "the attention backend is --attention-backend", json=True),
    "--kernel-config": VllmFlag("value", _GPU, json=True),
    "--additional-config": VllmFlag("value", "platform plugins' settings; no plugins here", json=True),
    "--profiler-config": VllmFlag("value", "profiling only", json=True),
    "--optimization-level": VllmFlag("value", _GPU),
    "--performance-mode": VllmFlag("value", _GPU),
    "--weight-transfer-config": VllmFlag("value", "no weight updates over the network", json=True),
    "--gdn-prefill-backend": VllmFlag("value", _GPU),
    "--linear-backend": VllmFlag("value", _GPU),
    "--kda-prefill-backend": VllmFlag("value", _GPU),
    "--spec-method": VllmFlag("value", "the method is --speculative-config's \"method\""),
}


# JSON configs that are pagedllm settings (EngineArgs fields that merge key=value parts): their dotted forms
# (--speculative-config.method=ngram) are rewritten as those of VLLM_FLAGS' JSON flags are.
JSON_SETTINGS = ("--speculative-config",)


def _dest(flag: str) -> str:
    return DEST_PREFIX + flag[2:].replace("-", "_")


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """Add ``VLLM_FLAGS`` (hidden from --help: one line there says they exist) to ``parser``, skipping those it
    already has, and ``--no-X`` for its store-true flags (vLLM's booleans all take it)."""
    group = parser.add_argument_group(
        "vLLM compatibility", "vLLM's other `vllm serve` flags are accepted (pagedllm/engine/vllm_compat.py): "
                              "applied where pagedllm has the feature; otherwise start-up warns that they have "
                              "no effect, or refuses the ones that would change results")
    known = parser._option_string_actions  # noqa: SLF001 - argparse exposes no public "has option" query
    for action in list(parser._actions):  # noqa: SLF001
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            for opt in action.option_strings:
                neg = "--no-" + opt[2:]
                if opt.startswith("--") and neg not in known:
                    group.add_argument(neg, dest=action.dest, action="store_false", default=argparse.SUPPRESS,
                                       help=argparse.SUPPRESS)
    for flag, spec in VLLM_FLAGS.items():
        if flag in known:
            continue
        kwargs: dict[str, Any] = {"dest": _dest(flag), "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if spec.kind in ("bool", "flag"):  # a vLLM store-true flag too: later versions give most a --no-X
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec.kind == "value":
            kwargs["action"] = "append"
        elif spec.kind == "optvalue":
            kwargs.update(action="append", nargs="?", const="")
        else:  # values
            kwargs.update(action="extend", nargs="+")
        group.add_argument(flag, *(a for a in spec.aliases if a not in known), **kwargs)


def _config_file_args(path: str) -> list[str]:
    """The flags a vLLM ``--config`` YAML file sets (``key: value``; true = the flag, false = omitted)."""
    import yaml  # lazily: only a --config launch reads YAML (pyyaml: 13 ms to import, not paid by the CLI's start)

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with vLLM's forms argparse cannot read rewritten (``argv[0]``: the subcommand; others untouched).

    ``--config FILE``: the YAML file's options go in right after the subcommand (the command line's own,
    after them, win). ``--x.key v`` / ``--x.key=v`` / ``--x.key+ v`` of a JSON-config flag in ``VLLM_FLAGS``:
    ``--x key=v`` (a dotted form with no value: ``key=true``). ``--max_num_seqs``: ``--max-num-seqs``, as vLLM
    reads it (its docs' Kubernetes example writes ``--max_num_batched_tokens``).

    Raises:
        ValueError: an unreadable --config file.
    """
    argv = list(argv)
    if not argv or argv[0] not in ("serve", "run-batch"):
        return argv
    head, rest = argv[:1], argv[1:]
    config: list[str] = []
    out: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok == "--config" and i + 1 < len(rest):
            config += _config_file_args(rest[i + 1])
            i += 2
            continue
        if tok.startswith("--config="):
            config += _config_file_args(tok.split("=", 1)[1])
            i += 1
            continue
        name, eq, value = tok.partition("=")
        base, dot, key = name.partition(".")
        if tok.startswith("--") and "_" in base:  # vLLM reads --max_num_seqs as --max-num-seqs
            base = "--" + base[2:].replace("_", "-")
            tok = base + (dot + key if dot else "") + eq + value
        if dot and tok.startswith("--") and (base in VLLM_FLAGS and VLLM_FLAGS[base].json or base in JSON_SETTINGS):
            if not eq:
                if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                    value, i = rest[i + 1], i + 1
                else:
                    value = "true"
            out += [base, f"{key.rstrip('+')}={value}"]
        else:
            out.append(tok)
        i += 1
    return head + config + out


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The ``VLLM_FLAGS`` given on the command line: flag -> value (as ``VllmFlag.refuse`` takes it)."""
    return {flag: getattr(args, _dest(flag)) for flag in VLLM_FLAGS if hasattr(args, _dest(flag))}


def check(args: argparse.Namespace) -> Optional[str]:
    """At start-up: apply the flags that stand for pagedllm options, refuse those that would change results,
    and return the one warning line naming the no-effect flags given (None when none was).

    Raises:
        ValueError: a flag whose value pagedllm cannot honour without changing results (the message names it).
    """
    ignored = []
    for flag, value in given(args).items():
        spec = VLLM_FLAGS[flag]
        if spec.refuse is not None and spec.refuse(value):
            shown = " ".join(map(str, value)) if isinstance(value, list) else ("" if value is True else value)
            raise ValueError(f"vLLM's {flag} {shown}".rstrip() + f" is not supported here and would change results: "
                             f"{spec.why}")
        if spec.validate is not None:
            spec.validate(args, value)
        # apply: the option it stands for is set; it may return a note on a part that has no effect
        note = spec.apply(args, value) if spec.apply is not None else spec.why
        if note:
            ignored.append(f"{flag} ({note})")
    if not ignored:
        return None
    return ("vLLM flags with no effect in pagedllm, accepted and ignored: " + "; ".join(ignored))

"""``--speculative-config`` / ``LLM(speculative_config=...)`` as vLLM takes it -> ``SpeculativeConfig``.

Accepted keys (vLLM's names): ``method`` ("ngram", "draft_model" or "mtp", vLLM's older names of mtp
``deepseek_mtp``, ``glm4_moe_mtp``, ``mimo_mtp`` taken as mtp; inferred from ``model`` when left out,
"[ngram]" meaning ngram as in vLLM), ``num_speculative_tokens`` (k >= 1, required),
``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram), ``model`` (draft_model: a checkpoint with the
target's vocabulary), ``quantization`` (the draft's), ``disable_by_batch_size`` (no proposals in a step
with more running sequences), ``draft_tensor_parallel_size`` (1 only), ``acceptance_method``
("rejection_sampler" only). Anything else is refused by name, as are the methods not implemented here.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.config import SpeculativeConfig
from pagedllm.models.mtp import num_mtp_layers

METHODS = ("ngram", "draft_model", "mtp")
# vLLM's per-family names of its MTP method (older releases): the checkpoint's own layers all the same
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "mimo_mtp")
# vLLM's other methods: refused with their name (they need heads or checkpoints pagedllm does not load)
OTHER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp",
                 "suffix")
KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max", "quantization",
        "disable_by_batch_size", "draft_tensor_parallel_size", "acceptance_method")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default n-gram length when neither bound is given


def parse_json_setting(value: str) -> dict:
    """One command-line value of a JSON-config flag: a JSON object, or ``key=value`` (vLLM's dotted
    form ``--speculative-config.method=ngram``, rewritten by ``vllm_compat.normalize_argv``), the
    value read as JSON where it is JSON (``k=4`` -> 4) else kept as a string.

    Raises:
        ValueError: neither form (argparse shows it as the flag's error).
    """
    value = value.strip()
    if value.startswith("{"):
        obj = json.loads(value)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {value!r}")
        return obj
    key, eq, raw = value.partition("=")
    if not eq or not key:
        raise ValueError(f"expected a JSON object or key=value, got {value!r}")
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = raw
    return {key.strip(): parsed}


def _int(cfg: dict, key: str, default: Optional[int], low: int) -> Optional[int]:
    v = cfg.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"speculative_config: {key} must be an integer >= {low}, got {v!r}")
    return v


def parse_speculative_config(value: Any) -> Optional[SpeculativeConfig]:
    """A dict (or JSON string) as vLLM takes it -> ``SpeculativeConfig`` without the draft's model config
    (``EngineArgs.create_engine_config`` resolves that); None for None / an empty dict.

    Raises:
        ValueError: an unknown key, an unsupported method or value (the message names it).
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_json_setting(value)
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict (or a JSON object), got {type(value).__name__}")
    if not value:
        return None
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise ValueError(f"speculative_config: {', '.join(map(repr, unknown))} not supported here (supported keys: "
                         f"{', '.join(KEYS)})")
    model = value.get("model")
    method = value.get("method")
    if method is None:
        if model is None:
            raise ValueError("speculative_config needs a method (ngram, draft_model or mtp) or a draft model")
        method = "ngram" if model in ("[ngram]", "ngram") else "draft_model"
    if method in MTP_ALIASES:
        method = "mtp"
    if method in OTHER_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not supported here (supported: "
                         f"{', '.join(METHODS)})")
    if method not in METHODS:
        raise ValueError(f"speculative_config: unknown method {method!r} (supported: {', '.join(METHODS)})")
    k = _int(value, "num_speculative_tokens", None, 1)
    if k is None and method == "mtp":
        k = 0  # as vLLM: the checkpoint's num_nextn_predict_layers (EngineArgs resolves it)
    elif k is None:
        raise ValueError("speculative_config: num_speculative_tokens is required (k proposals a step, >= 1)")
    if _int(value, "draft_tensor_parallel_size", 1, 1) != 1:
        raise ValueError("speculative_config: draft_tensor_parallel_size must be 1 (the draft runs unsharded)")
    if value.get("acceptance_method", "rejection_sampler") != "rejection_sampler":
        raise ValueError(f"speculative_config: acceptance_method {value['acceptance_method']!r} is not supported "
                         f"(rejection_sampler only: it keeps the target's distribution)")
    lo = _int(value, "prompt_lookup_min", None, 1)
    hi = _int(value, "prompt_lookup_max", None, 1)
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min={lo} is more than prompt_lookup_max={hi}")
    if method == "draft_model":
        if not model or model in ("[ngram]", "ngram"):
            raise ValueError("speculative_config: method draft_model needs model (the draft checkpoint)")
    elif "model" in value and model not in ("[ngram]", "ngram", None):
        if method != "mtp":
            raise ValueError(f"speculative_config: method ngram takes no model (got {model!r})")
        # (vLLM lets mtp name the target itself; its layers are the target checkpoint's, whatever is named)
    quant = value.get("quantization")
    if quant is not None and method != "draft_model":
        raise ValueError("speculative_config: quantization applies to a draft model only")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                             model=model if method in ("draft_model", "mtp") else None,
                             disable_by_batch_size=_int(value, "disable_by_batch_size", None, 1),
                             draft_quantization=None if quant in (None, "none") else quant)


def check_mtp_checkpoint(hf_config, model_cls: type) -> None:
    """Raise ValueError where the checkpoint has no MTP layer the mtp method runs (no
    ``num_nextn_predict_layers``, or a family without MTP support here: no ``mtp_layout``)."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if num_mtp_layers(hf_config) < 1:
        raise ValueError(f"speculative_config: method mtp needs a checkpoint with multi-token-prediction layers "
                         f"(num_nextn_predict_layers >= 1 in its config); {arch} has none (use ngram or "
                         f"draft_model)")
    if getattr(model_cls, "mtp_layout", None) is None:
        raise ValueError(f"speculative_config: method mtp runs the MTP layers of DeepSeek-V3/R1, GLM-4.5 and MiMo "
                         f"checkpoints, not {arch}'s")

"""Build a model and load its weights from safetensors (one file or a sharded index), or fill
it with random weights (``load_format="dummy"``)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import logging

import torch
from safetensors import safe_open

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_tp_rank
from pagedllm.layers.quantization import get_quantization_config, process_weights_after_loading
from pagedllm.models.registry import get_model_class


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files (from model.safetensors.index.json when present).

    Raises:
        FileNotFoundError: the folder has none.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir} (use load_format='dummy' for random weights)")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs; a slice reads from disk only the part a rank indexes."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


logger = logging.getLogger("pagedllm")


def load_model(model_config: ModelConfig, device: str) -> torch.nn.Module:
    """Instantiate the registered architecture on ``device`` in ``model_config.dtype``, load it,
    then let each layer's linear method process its weights (e.g. quantize them to int8)."""
    cls = get_model_class(model_config.hf_config, model_config.max_model_len)
    with torch.device(device):
        model = cls(model_config.hf_config, model_config.dtype)
    if model_config.load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(model_config.seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
            else:
                # Small uniform values keep activations finite through many layers.
                p.data.copy_(torch.empty(p.shape).uniform_(-0.02, 0.02, generator=gen).to(p.dtype))
    else:
        model.load_weights(iterate_weights(model_config.model))
    quant_config = get_quantization_config(model_config.quantization)
    report = process_weights_after_loading(model, quant_config)
    model.quantization_report = report
    if quant_config is not None and get_tp_rank() == 0:
        logger.info("quantization=%s: %d layers quantized; weights %.1f MiB -> %.1f MiB per rank (saved %.1f MiB)",
                    report.method, report.num_quantized, report.bytes_before / 2**20, report.bytes_after / 2**20,
                    report.bytes_saved / 2**20)
    return model.eval()

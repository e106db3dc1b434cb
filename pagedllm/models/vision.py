"""What a model family's vision tower provides (``models/<family>_vision.py``, beside its language
model), and how the engine finds it (``models/registry.py``: ``get_vision_tower_class``).

A tower is built from the checkpoint's whole config (``hf_config``: the outer config with
``vision_config`` and ``text_config``; the language model is built from ``text_config`` as before),
loads the checkpoint's vision-tower and projector tensors, and turns one image's processed tensors into
the embedding rows that replace the image's placeholder tokens in the prompt.

The class methods run in the API server process (no weights): they make transformers' processor, run
it on (prompt text, images) and say where each image's placeholder tokens sit. ``encode`` runs in the
model runner. Everything crossing between the two is a dict of CPU tensors per image
(``multimodal/inputs.py``: ``MultiModalFeature.data``).

Positions: a family whose language model uses M-RoPE (Qwen2-VL) returns ``mrope_positions``; the
engine then gives its model positions [3, N] (``engine/input_batch.py``) instead of [N].
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

# Checkpoint name prefixes of the vision side (transformers 5 puts them under "model.", 4.x did not).
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "model.vision_tower.",
                   "model.multi_modal_projector.", "model.visual.")


# A LLaVA-style checkpoint's tower (transformers' vision model) and projector. The Hub's checkpoints nest
# the tower under "vision_model."; transformers 5 saves it without.
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                  "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class VisionTower(nn.Module):
    """Base of a family's vision tower + projector.

    Subclasses define ``__init__(hf_config, dtype)``, ``load_weights`` and ``encode``; the class
    methods below have defaults that fit LLaVA and Gemma 3 (override where a family differs).
    """

    # Whether an image's placeholder tokens attend to each other both ways in the language model
    # (Gemma 3: transformers' token_type_ids mask); the engine then marks each image span of a prefill
    # chunk (``PrefillSeq.bidirectional``) and keeps it in one chunk. False: plain causal attention.
    bidirectional_image_attention = False

    # ---- API server side (class methods: no weights) --------------------------------------
    @classmethod
    def image_token_id(cls, hf_config: Any) -> int:
        """The placeholder token id the processor repeats once per embedding row."""
        tid = getattr(hf_config, "image_token_id", None)
        if tid is None:
            tid = getattr(hf_config, "image_token_index", None)
        if tid is None:
            raise ValueError(f"{type(hf_config).__name__} names no image token id")
        return int(tid)

    @classmethod
    def make_processor(cls, model_path: str, hf_config: Any) -> Any:
        """transformers' processor of the checkpoint (``AutoProcessor``: image processor + tokenizer +
        placeholder expansion). Raises ValueError when the checkpoint has none."""
        from transformers import AutoProcessor  # lazily: transformers, ~1 s to import

        try:
            return AutoProcessor.from_pretrained(model_path)
        except Exception as e:  # noqa: BLE001 - missing/bad preprocessor_config.json, no torchvision, ...
            raise ValueError(f"cannot load the image processor of {model_path}: {type(e).__name__}: {e}") from None

    @classmethod
    def image_placeholder(cls, processor: Any) -> str:
        """The text that stands for one image in a prompt before expansion (LLaVA: "<image>", Gemma 3:
        "<start_of_image>"): what ``LLM.generate`` prompts and chat templates write."""
        token = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
        if not token:
            raise ValueError(f"{type(processor).__name__} names no image placeholder")
        return token

    @classmethod
    def process(cls, processor: Any, text: str, images: list, add_special_tokens: bool = True
                ) -> dict[str, torch.Tensor]:
        """Run the processor on the prompt ``text`` (one placeholder per image) and the PIL images:
        {"input_ids": [1, L], "pixel_values": [n, 3, H, W], ...} (transformers' BatchFeature as a dict).
        ``add_special_tokens``: as the tokenizer's (False for a rendered chat, whose template wrote them)."""
        out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
        return dict(out)

    @classmethod
    def split_items(cls, processed: dict[str, torch.Tensor], num_images: int) -> list[dict[str, torch.Tensor]]:
        """The processor's batched image tensors -> one dict per image (default: row i of every
        tensor whose first dimension is ``num_images``; token-level outputs are left out)."""
        keys = [k for k, v in processed.items() if k not in ("input_ids", "attention_mask", "token_type_ids")
                and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == num_images]
        return [{k: processed[k][i] for k in keys} for i in range(num_images)]

    @classmethod
    def placeholder_ranges(cls, hf_config: Any, input_ids: list[int], items: list[dict[str, torch.Tensor]]
                           ) -> list[tuple[int, int, Optional[list[bool]]]]:
        """(offset, length, is_embed) of each image's placeholder span in ``input_ids``, in image order
        (default: each maximal run of the image token, adjacent images' runs split evenly; is_embed None).
        Raises ValueError when the runs do not match the images."""
        tid = cls.image_token_id(hf_config)
        runs: list[tuple[int, int, Optional[list[bool]]]] = []
        i, n = 0, len(input_ids)
        while i < n:
            if input_ids[i] == tid:
                j = i
                while j < n and input_ids[j] == tid:
                    j += 1
                runs.append((i, j - i, None))
                i = j
            else:
                i += 1
        if 0 < len(runs) < len(items):
            runs = cls._split_adjacent_runs(runs, len(items))
        if len(runs) != len(items):
            raise ValueError(f"the prompt has {len(runs)} image placeholder span(s) for {len(items)} image(s)")
        return runs

    @staticmethod
    def _split_adjacent_runs(runs: list[tuple[int, int, Optional[list[bool]]]], num_images: int
                             ) -> list[tuple[int, int, Optional[list[bool]]]]:
        """Placeholders written back to back ("<image><image>") expand into one run of image tokens;
        when every image has the same token count (LLaVA: a fixed image size), split each run into
        spans of that count, as transformers' masked scatter fills them in order. Runs that do not
        divide evenly are returned unchanged (the caller then refuses the prompt)."""
        total = sum(length for _, length, _ in runs)
        if total % num_images:
            return runs
        per = total // num_images
        if any(length % per for _, length, _ in runs):
            return runs
        return [(off + k * per, per, None) for off, length, _ in runs for k in range(length // per)]

    @classmethod
    def mrope_positions(cls, hf_config: Any, input_ids: list[int], items: list[dict[str, torch.Tensor]]
                        ) -> Optional[tuple[torch.Tensor, int]]:
        """For an M-RoPE language model: (positions [3, L] int64 of the prompt, delta) where a token
        after the prompt at index t has position t + delta on all rows. None: plain 1-D positions."""
        return None

    # ---- model runner side ------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's vision tensors (names as in the checkpoint, starting with one of
        VISION_PREFIXES). Raises ValueError on a shape mismatch or a missing tensor. Default: a
        LLaVA-style layout, the tower (TOWER_PREFIXES) into ``self.vision_model``, the projector
        (PROJECTOR_PREFIXES) into ``self.projector``, under transformers' names."""
        name = type(self).__name__
        load_parts(weights, [(TOWER_PREFIXES, self.vision_model, f"{name}'s tower"),
                             (PROJECTOR_PREFIXES, self.projector, f"{name}'s projector")])

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One dict per image (``split_items``' tensors, on this tower's device) -> per image its
        embedding rows [num_embeds, text_hidden_size] in the language model's dtype."""
        raise NotImplementedError


def strip_prefix(name: str, prefixes: tuple[str, ...]) -> Optional[str]:
    """``name`` without the first of ``prefixes`` it starts with, or None when it starts with none."""
    for p in prefixes:
        if name.startswith(p):
            return name[len(p):]
    return None


def load_module_weights(module: nn.Module, weights: list[tuple[str, torch.Tensor]], what: str) -> None:
    """Copy (name, tensor) pairs into ``module``'s parameters of those names; names it lacks are
    skipped (layers past the ones a tower uses, a pooling head it does not). Raises ValueError on a
    shape mismatch or a parameter left unloaded, naming ``what``."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, w in weights:
        p = params.get(name)
        if p is None:
            continue
        w = w[:] if not isinstance(w, torch.Tensor) else w  # (a safetensors slice)
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(f"{what} weight {name}: shape {tuple(w.shape)} does not match {tuple(p.shape)}")
        p.data.copy_(w.to(p.dtype))
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"{what}: checkpoint is missing weights: {sorted(missing)[:6]}")


def load_parts(weights: Iterable[tuple[str, Any]], parts: list[tuple[tuple[str, ...], nn.Module, str]]) -> None:
    """Route checkpoint tensors into modules by name prefix: ``parts`` lists (prefixes, module, what);
    a tensor goes, its first matching prefix stripped, to the first part whose prefixes it starts with
    (``load_module_weights`` per part: names a module lacks are skipped, a missing one raises)."""
    routed: list[list] = [[] for _ in parts]
    for name, w in weights:
        for i, (prefixes, _, _) in enumerate(parts):
            rest = strip_prefix(name, prefixes)
            if rest is not None:
                routed[i].append((rest, w))
                break
    for (_, module, what), items in zip(parts, routed):
        load_module_weights(module, items, what)

"""Which model names the server answers to: the base model and its LoRA adapters (vLLM's
``OpenAIServingModels``).

``--lora-modules name=path`` (or the JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``)
registers adapters at start; with ``--allow-runtime-lora-updating`` (or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter {"lora_name"}``
change the set while serving. A request's ``model`` picks the base model or an adapter; an unknown name
is a 404 as for an unknown model. Loading reads and checks the adapter off the event loop and the
engine thread (a bad one is a 400 naming why); requests in flight are not disturbed, and those running
with an adapter that is unloaded finish with it.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.openai.protocol import ModelCard, RequestError
from pagedllm.lora.peft import load_peft_adapter
from pagedllm.lora.request import LoRARequest


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_modules(values: Optional[list[str]]) -> list[LoRAModulePath]:
    """``--lora-modules`` values -> adapters. Raises ValueError on a value of neither form."""
    out = []
    for v in values or []:
        v = v.strip()
        if v.startswith("{"):
            try:
                obj = json.loads(v)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {v!r} is not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
                raise ValueError(f"--lora-modules: {v!r} needs \"name\" and \"path\"")
            out.append(LoRAModulePath(str(obj["name"]), str(obj["path"]), obj.get("base_model_name")))
        elif "=" in v:
            name, path = v.split("=", 1)
            if not name or not path:
                raise ValueError(f"--lora-modules: {v!r} is not name=path")
            out.append(LoRAModulePath(name, path))
        else:
            raise ValueError(f"--lora-modules: {v!r} is not name=path or a JSON object")
    return out


class OpenAIServingModels:
    def __init__(self, llm: AsyncLLM, served_model_name: str, lora_modules: Optional[list[str]] = None,
                 allow_runtime_updates: bool = False) -> None:
        self.llm = llm
        self.served = served_model_name
        self.allow_runtime_updates = allow_runtime_updates
        self.loras: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._ids = itertools.count(1)
        modules = parse_lora_modules(lora_modules)
        if modules and llm.engine.config.lora_config is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for m in modules:
            self.register(m.name, m.path, m.base_model_name)

    @property
    def lora_config(self):
        return self.llm.engine.config.lora_config

    def register(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Check the adapter (ValueError naming why it cannot be served) and serve it as ``name``."""
        if name == self.served or name in self.loras:
            raise ValueError(f"the model name {name!r} is already in use")
        lc = self.lora_config
        load_peft_adapter(path, lc.max_lora_rank, self.llm.engine.model_config.hf_config)
        req = LoRARequest(name, next(self._ids), path, base_model_name=base_model_name)
        self.llm.register_lora(req)  # checked: the engine (core) does not read it again
        self.loras[name] = req
        self.parents[name] = base_model_name or self.served
        return req

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """None for the base model (or no name), the adapter's request for an adapter; 404 otherwise."""
        if model is None or model == self.served:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise RequestError(f"The model `{model}` does not exist.", "model", 404, "model_not_found")
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        base = ModelCard(id=self.served, root=self.llm.model_config.model, max_model_len=max_model_len)
        return [base] + [ModelCard(id=name, root=req.lora_path, parent=self.parents[name], max_model_len=max_model_len)
                         for name, req in self.loras.items()]

    def _check_updating(self) -> None:
        if not self.allow_runtime_updates:
            raise RequestError("runtime LoRA updates are off: start the server with --allow-runtime-lora-updating "
                               "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", None, 400, "lora_updates_disabled")
        if self.lora_config is None:
            raise RequestError("LoRA is off: start the server with --enable-lora", None, 400)

    async def load(self, body: Any) -> str:
        self._check_updating()
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise RequestError("both 'lora_name' and 'lora_path' must be given", "lora_name", 400)
        if name == self.served or name in self.loras:
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name", 400)
        try:  # (reads the files: off the event loop; the engine thread keeps stepping)
            await asyncio.to_thread(self.register, name, path, body.get("base_model_name"))
        except ValueError as e:
            raise RequestError(f"cannot load LoRA adapter {name!r}: {e}", "lora_path", 400) from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: Any) -> str:
        self._check_updating()
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError("'lora_name' must be given", "lora_name", 400)
        req = self.loras.pop(name, None)
        if req is None:
            raise RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name", 404, "model_not_found")
        self.parents.pop(name, None)
        self.llm.unregister_lora(req.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

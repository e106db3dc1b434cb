"""LoRA adapters served over one base model (vLLM's ``--enable-lora``).

- ``request.py``: ``LoRARequest`` (name, id, path), what a request names to use an adapter.
- ``peft.py``: PEFT's format (adapter_config.json + adapter_model.safetensors) read and checked.
- ``slots.py``: the engine's slot table (``--max-loras`` adapters a step, LRU) and the per-token slot ids.
- ``ops.py``: the batched op: tokens grouped by adapter, shrink (x A^T) then expand (h B^T), added to
  the base linear's output (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023).
- ``layers.py``: a target linear's slot buffers (TP-sharded as the base layer) and its forward hook.
- ``runtime.py``: a model runner's side: the wrapped model, the CPU cache of adapters (``--max-cpu-loras``).
"""

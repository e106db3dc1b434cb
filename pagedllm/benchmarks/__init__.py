"""Benchmarks (``pagedllm bench ...``): offline throughput against transformers, an online
serving client, KV-cache memory efficiency, and a decode-step profile. See ``benchmarks/README.md``."""

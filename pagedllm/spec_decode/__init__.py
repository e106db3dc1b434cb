"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the rejection sampler
that verifies their proposals against the target model (Leviathan et al., ICML 2023; Chen et al.,
2023), so that the output follows the target's distribution exactly. The engine's side (which
requests propose, the verification batch, rolling back rejected slots) is ``engine/speculator.py``.
"""

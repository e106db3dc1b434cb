"""Greedy ids of a fixed set of prompts, and where two id lists part: the agreement figures of the
quality benches (``bench quantization``: int8 vs fp32; ``bench perplexity``: GGUF blocks on our
kernels vs dequantized)."""
from __future__ import annotations

from pagedllm.sampling_params import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "Give me three tips for learning Python.", "What is 17 times 23?", "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.", "What are the primary colors?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Suggest a name for a bakery.",
    "What does a CPU do?", "List the planets of the solar system.", "How do I boil an egg?",
    "What is the difference between weather and climate?", "Tell me a short joke.",
    "Summarize the plot of Cinderella.", "What is machine learning?", "How many days are in a leap year?",
    "Write one sentence about autumn.",
]
PLAIN_PROMPTS = [
    "ROMEO:", "JULIET:", "KING RICHARD II:", "First Citizen:", "MENENIUS:", "HAMLET:", "QUEEN ELIZABETH:",
    "GLOUCESTER:", "To be, or not", "O Romeo, Romeo,", "Now is the winter", "My lord,", "Good morrow,",
    "What say you", "The king is", "Come, come,", "I pray thee", "Farewell,", "Alas, poor", "Friends, Romans,",
]


def greedy_outputs(llm, n: int) -> list[list[int]]:
    """Greedy ids ([20 prompts][n]) of CHAT_PROMPTS through the chat template where the tokenizer has
    one, else of PLAIN_PROMPTS; ``ignore_eos`` so every list has ``n`` ids."""
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    if getattr(llm.get_tokenizer(), "chat_template", None):
        outs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], sp, use_tqdm=False)
    else:
        outs = llm.generate(PLAIN_PROMPTS, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

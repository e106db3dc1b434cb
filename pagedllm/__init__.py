"""pagedllm: LLM inference and serving with PagedAttention and continuous batching."""
import os as _os

# libgomp (PyTorch's OpenMP on Linux) spins 300,000 times at every barrier before sleeping. Where
# another busy process shares the cores (a second server, a client on the same host), the team
# spins on a descheduled member at every one of a step's hundreds of parallel regions: a SmolLM2
# decode step took 1.6 s beside a second engine, against 0.1 s with 1,000 spins (its fair share),
# while alone 1,000 spins measured the same as 300,000 (batch 1 and 48, served w48; benchmarks
# section 16). libgomp reads this when it loads, with torch: so only where the user set neither
# variable, and only before torch is imported (always so for the CLI).
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "1000"

from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402 (after the OpenMP setting)
from pagedllm.llm import LLM  # noqa: E402
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs",
           "StructuredOutputsParams", "__version__"]

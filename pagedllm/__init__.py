"""pagedllm: LLM inference and serving with PagedAttention and continuous batching."""
from pagedllm.config import EngineArgs
from pagedllm.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs",
           "StructuredOutputsParams", "__version__"]

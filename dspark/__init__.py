"""dspark: an LLM inference engine built around DSpark confidence-scheduled speculative decoding."""

from dspark.llm import LLM
from dspark.outputs import CompletionOutput, RequestOutput
from dspark.sampling_params import SamplingParams, StructuredOutputsParams
from dspark.version import __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

"""tsterm: a terminal workstation for running Mixture-of-Experts language models locally."""
from tsterm.config import EngineConfig, SamplingParams
from tsterm.llm import LLM
from tsterm.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

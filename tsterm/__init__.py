"""tsterm: a terminal workstation for running Mixture-of-Experts language models locally.

The package's face is lazy: `from tsterm import LLM` imports the engine (and torch) when asked for, so that
`import tsterm` alone, `tsterm --help`, `tsterm plan` and `tsterm profiles ...` never load torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tsterm.config import EngineConfig, SamplingParams
    from tsterm.llm import LLM
    from tsterm.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562), then kept as a package attribute."""
    if name == "LLM":
        from tsterm.llm import LLM as value
    elif name in ("SamplingParams", "EngineConfig"):
        from tsterm import config
        value = getattr(config, name)
    elif name in ("RequestOutput", "CompletionOutput"):
        from tsterm import outputs
        value = getattr(outputs, name)
    else:
        raise AttributeError(f"module 'tsterm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

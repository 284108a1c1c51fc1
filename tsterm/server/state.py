"""What every route of the server shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tsterm.config import SamplingParams


@dataclass
class ServerLimits:
    max_body_bytes: int = 4 << 20  # a request body past this is a 413
    max_queued_requests: int = 256  # requests admitted but not finished; past it a 429
    max_n: int = 8  # choices per chat completion


@dataclass
class ServerState:
    """The engine behind the API and the served model's identity. `engine` is a tsterm AsyncEngine; `tokenizer`
    renders chat templates; `defaults` are the profile's sampling defaults a request's fields override."""

    engine: Any
    tokenizer: Any
    model_name: str
    max_model_len: int
    defaults: SamplingParams = field(default_factory=SamplingParams)
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    in_flight: int = 0  # admitted requests not yet finished (the queue bound counts these)

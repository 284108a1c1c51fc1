"""A request's structured output, from the fields clients send, checked before it reaches the engine.

OpenAI's `response_format`: `{"type": "text"}` asks nothing; `{"type": "json_object"}` is any JSON object;
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` is the schema, enforced whether `strict` is
true or not (as vLLM does). vLLM's own `structured_outputs` body field is taken as the engine takes it
(tsterm/config.py `StructuredOutputs`: exactly one of json, json_object, regex, choice, grammar). A request may send
one of the two. The tool-call grammar of tool_choice "required" / a named tool is tool_choice's.

Whatever the grammar, it is compiled here first, without the tokenizer (llguidance's `validate_grammar`), so that a
schema or grammar llguidance cannot compile is a 400 naming the client's field (`response_format.json_schema.schema`,
`structured_outputs.regex`, ...) and the construct, before the request is admitted, streamed or not: a stream has
sent its status line by the time the engine would say so.
"""
from __future__ import annotations

from typing import Any

import llguidance

from tsterm.config import StructuredOutputs
from tsterm.engine.structured import grammar_source
from tsterm.errors import ConfigError
from tsterm.server.errors import APIError
from tsterm.server.protocol import ResponseFormat

SCHEMA_PARAM = "response_format.json_schema.schema"


def from_request(response_format: ResponseFormat | None,
                 structured_outputs: dict[str, Any] | None) -> tuple[StructuredOutputs | None, str]:
    """(the request's structured output or None, the client field it came from: the `param` of its errors)."""
    if response_format is not None and response_format.type != "text" and structured_outputs is not None:
        raise APIError(400, "send response_format or structured_outputs, not both", param="structured_outputs")
    if structured_outputs is not None:
        try:
            spec = StructuredOutputs(**structured_outputs)
        except TypeError as e:
            raise APIError(400, f"structured_outputs: {e}; it takes json, json_object, regex, choice, grammar and "
                           "disable_any_whitespace", param="structured_outputs") from e
        except ConfigError as e:
            raise APIError(400, str(e), param="structured_outputs") from e
        return spec, f"structured_outputs.{spec.kind}"
    if response_format is None or response_format.type == "text":
        return None, ""
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True), "response_format"
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise APIError(400, "response_format type \"json_schema\" needs json_schema.schema, the JSON schema the reply "
                       "must follow", param=SCHEMA_PARAM)
    return StructuredOutputs(json=response_format.json_schema.schema_), SCHEMA_PARAM


def check(spec: StructuredOutputs | None, param: str) -> None:
    """A 400 naming `param` and the construct when llguidance cannot compile `spec`'s grammar."""
    if spec is None:
        return
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_source(spec), None)
    except ValueError as e:  # the schema's JSON text does not parse, or it is not an object
        raise APIError(400, f"{param}: {e}", param=param) from e
    if error:
        raise APIError(400, f"{param} cannot be enforced: {_readable(error)}", param=param)


def _readable(error: str) -> str:
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return " ".join(lines)

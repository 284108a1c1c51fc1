"""Tool arguments against their JSON schema: `jsonschema` does the checking (the draft a schema's `$schema` names,
else 2020-12); this module words each problem for the model that wrote the call, naming the field by its path
(`arguments.paths[2]: expected string, got integer 3`).

A schema that is itself invalid (a client's or a profile's typo) is checked as far as jsonschema can take it: the
problems found before a keyword it cannot apply are reported, and the call is not refused for the schema's fault.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError
from referencing.exceptions import Unresolvable


class ArgumentSchema:
    """One tool's parameter schema, compiled once; `problems(value)` lists what is wrong with a call's arguments."""

    def __init__(self, schema: Any):
        if not isinstance(schema, Mapping):
            schema = {}  # nothing to check against (the old subset checker ignored a non-object schema too)
        validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            validator_class.check_schema(schema)
            self.schema_error: jsonschema.SchemaError | None = None
        except jsonschema.SchemaError as err:
            self.schema_error = err
        self._validator = validator_class(schema)

    def problems(self, value: Any, path: str = "arguments") -> list[str]:
        """One message per problem, each starting with the bad field's path under `path`; [] when `value` fits."""
        messages: list[str] = []
        try:
            for error in self._validator.iter_errors(value):
                messages += describe(error, path)
        except Unresolvable as err:  # a $ref to nothing (or to a remote document: nothing is fetched)
            messages.append(f"{path}: the tool's schema has a reference that cannot be resolved ({err})")
        except (jsonschema.exceptions.UnknownType, TypeError, AttributeError, KeyError, ValueError, re.error):
            if self.schema_error is None:  # a valid schema never gets here: a bug to see, not to hide
                raise
        return list(dict.fromkeys(messages))  # `required` and `additionalProperties` name all their fields at once


def check(value: Any, schema: Any, path: str = "arguments") -> list[str]:
    """`ArgumentSchema(schema).problems(value, path)`, for a schema checked once."""
    return ArgumentSchema(schema).problems(value, path)


def field_path(path: str, parts: Any) -> str:
    """`arguments` + ["paths", 2] -> `arguments.paths[2]`."""
    return path + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)


def describe(error: ValidationError, path: str) -> list[str]:
    """The messages for one jsonschema error: the common keywords worded for a model, the rest as jsonschema puts
    them, each after the field's path."""
    where = field_path(path, error.absolute_path)
    keyword, expected, value = error.validator, error.validator_value, error.instance
    if keyword == "type":
        types = [expected] if isinstance(expected, str) else list(expected)
        return [f"{where}: expected {' or '.join(types)}, got {json_type(value)} {short(value)}"]
    if keyword == "enum":
        return [f"{where}: {short(value)} is not one of {json.dumps(expected)}"]
    if keyword == "const":
        return [f"{where}: must be {json.dumps(expected)}, got {short(value)}"]
    if keyword == "required" and isinstance(value, Mapping):
        return [f"{where}: missing required field {key!r}" for key in expected if key not in value]
    if keyword == "additionalProperties" and expected is False and isinstance(value, Mapping):
        properties = error.schema.get("properties", {})
        patterns = list(error.schema.get("patternProperties", {}))
        allowed = ", ".join(properties) or "none"
        return [f"{where}: unexpected field {key!r} (allowed: {allowed})" for key in value
                if key not in properties and not any(re.search(pattern, key) for pattern in patterns)]
    bounds = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
    if keyword in bounds and not isinstance(expected, bool):
        return [f"{where}: must be {bounds[keyword]} {expected}, got {short(value)}"]
    return [f"{where}: {error.message}"]


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def short(value: Any) -> str:
    """A value as JSON, cut to 40 characters."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."

"""A request's output constraint: OpenAI's `response_format` and vLLM's `structured_outputs` (and its older
`guided_*` fields), read into one ConstraintSpec (decoding/constraint.py). Two constraints at once, or a field
of the wrong shape, is a 400 naming it; whether the grammar compiles is checked at intake."""

from __future__ import annotations

from typing import Any

from dflash_cli.decoding.constraint import ConstraintSpec

# vLLM's structured_outputs keys (and their guided_* forerunners) -> our kinds
_VLLM = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def read_constraint(body: dict[str, Any], error: type[Exception]) -> ConstraintSpec | None:
    """The one constraint `body` asks for, or None; `error(message, param=...)` for a bad one."""
    found: list[tuple[str, ConstraintSpec]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt, error)
        if spec is not None:
            found.append(("response_format", spec))
    extras = body.get("structured_outputs")
    if extras is not None:
        if not isinstance(extras, dict):
            raise error("'structured_outputs' must be an object", param="structured_outputs")
        found += [(f"structured_outputs.{k}", _vllm(k, v, error)) for k, v in extras.items() if v not in (None, False)]
    found += [(f"guided_{k}", _vllm(k, body[f"guided_{k}"], error)) for k in _VLLM if body.get(f"guided_{k}")]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise error(f"one output constraint per request, got {names}", param=found[1][0])
    return found[0][1] if found else None


def _response_format(fmt: Any, error: type[Exception]) -> ConstraintSpec | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise error("response_format.json_schema.schema must be a JSON schema object", param="response_format")
        return ConstraintSpec("json_schema", schema)
    raise error("response_format.type must be 'text', 'json_object' or 'json_schema'", param="response_format")


def _vllm(key: str, value: Any, error: type[Exception]) -> ConstraintSpec:
    param = f"structured_outputs.{key}"
    if key not in _VLLM:
        raise error(f"{param} is not supported (one of: {', '.join(_VLLM)})", param=param)
    kind = _VLLM[key]
    if kind == "json_schema":
        import json

        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            raise error(f"{param} must be a JSON schema (an object, or a string holding one)", param=param)
        return ConstraintSpec(kind, schema)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise error(f"{param} must be a list of non-empty strings", param=param)
        return ConstraintSpec(kind, list(value))
    if kind == "json_object":
        return ConstraintSpec(kind)
    if not isinstance(value, str) or not value:
        raise error(f"{param} must be a non-empty string", param=param)
    return ConstraintSpec(kind, value)

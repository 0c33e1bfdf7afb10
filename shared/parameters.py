"""The parameters a flow declares: a JSON Schema (Draft 2020-12) of the submit parameters.

The schema is checked when flows.yaml loads (:func:`schema_problems`); each new
task's parameters are checked against it at submit, defaults filled in first
(:func:`checked`). Problems are ``(field, problem)`` pairs whose field starts with
``parameters``, as the API's other 422 answers name their fields.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from shared.errors import ServiceError

Problem = tuple[str, str]

# An answer names this many problems at most: enough to fix a request, not a flood.
MAX_PROBLEMS = 20
# Values are quoted in problems up to this length (a parameter may be a long string).
MAX_QUOTED = 80

_META = Draft202012Validator(Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER)
# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
# Keywords whose keys are names (of properties, definitions), so a name may be "enum" or "default".
_NAMING_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class InvalidParameters(ServiceError):
    """Parameters a flow's declaration refuses; ``problems`` and ``detail`` name each one."""

    status_code = 422

    def __init__(self, problems: Sequence[Problem], flow: str | None = None) -> None:
        what = f"invalid parameters for flow {flow!r}" if flow else "invalid parameters"
        super().__init__(f"{what}: " + "; ".join(f"{f}: {p}" for f, p in problems))
        self.problems = list(problems)
        self.detail = [{"field": f, "problem": p} for f, p in problems]


def schema_problems(schema: Any) -> list[Problem]:
    """What makes ``schema`` unusable as a flow's ``parameters``; fields are paths inside it."""
    if not isinstance(schema, dict):
        return [("", "must be a mapping: a JSON Schema of the parameters object")]
    try:
        json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # YAML can hold what JSON cannot: a date (2024-01-01 unquoted), NaN (.nan).
        return [("", f"must be JSON (quote dates in YAML): {exc}")]
    problems = [(_path(e.absolute_path), _meta_message(e)) for e in _META.iter_errors(schema)]
    if problems:
        return sorted(problems)
    if schema.get("type", "object") != "object":
        problems.append(("type", "must be object: a task's parameters are a mapping of names to values"))
    problems += _reference_problems(schema)
    if problems:
        return problems
    # Each default must pass its own property's schema, or every task relying on it would be refused.
    defaults = _defaults(schema)
    for error in Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER).iter_errors(defaults):
        if error.absolute_path and error.absolute_path[0] in defaults:
            name = error.absolute_path[0]
            problems.append((f"properties.{name}.default", _message(error)))
    return problems


def checked(schema: Mapping[str, Any], values: Mapping[str, Any], flow: str | None = None) -> dict[str, Any]:
    """``values`` with the schema's top-level defaults filled in; :class:`InvalidParameters` if they do not pass."""
    filled = dict(values)
    for name, default in _defaults(schema).items():
        filled.setdefault(name, copy.deepcopy(default))
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    problems = sorted({p for error in validator.iter_errors(filled) for p in _problems(error, schema)})
    if problems:
        raise InvalidParameters(problems[:MAX_PROBLEMS], flow)
    return filled


def _defaults(schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return {}
    return {name: sub["default"] for name, sub in properties.items() if isinstance(sub, dict) and "default" in sub}


def _problems(error: ValidationError, schema: Mapping[str, Any]) -> Iterator[Problem]:
    """The problems of one validation error, each on the parameter it concerns."""
    where = "parameters" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    instance = error.instance
    if error.validator == "required" and isinstance(instance, dict) and isinstance(error.validator_value, list):
        for name in error.validator_value:
            if name not in instance and error.message.startswith(f"{name!r} "):
                yield f"{where}.{name}", "is required"
        return
    if error.validator == "additionalProperties" and error.validator_value is False and isinstance(instance, dict):
        node = _node(schema, error.absolute_schema_path)
        declared = node.get("properties") or {}
        patterns = list(node.get("patternProperties") or {})
        allowed = ", ".join(sorted(declared)) or "none"
        for name in sorted(instance):
            if name not in declared and not any(re.search(p, name) for p in patterns):
                yield f"{where}.{name}", f"is not a parameter of this flow (declared: {allowed})"
        return
    yield where, _message(error)


def _node(schema: Mapping[str, Any], schema_path: Sequence[Any]) -> Mapping[str, Any]:
    """The (sub)schema holding the keyword at ``schema_path``."""
    node: Any = schema
    for part in list(schema_path)[:-1]:
        node = node[part]
    return node if isinstance(node, dict) else {}


def _message(error: ValidationError) -> str:
    """jsonschema's message, the refused value shortened if it is long."""
    text = error.message
    shown = repr(error.instance)
    if len(shown) > MAX_QUOTED and text.startswith(shown):
        text = shown[: MAX_QUOTED - 3] + "..." + text[len(shown) :]
    return text


def _meta_message(error: ValidationError) -> str:
    # "not valid under any of the given schemas" says little; the closest alternative says what is wrong.
    return _message(best_match(error.context)) if error.context else _message(error)


def _reference_problems(schema: dict[str, Any]) -> list[Problem]:
    """References that lead nowhere: only those inside the schema resolve (nothing is fetched)."""
    resolver = Registry().with_resource("", DRAFT202012.create_resource(schema)).resolver()
    problems = []
    for path, ref in _references(schema, ()):
        try:
            resolver.lookup(ref)
        except Unresolvable:
            problems.append((_path(path), f"{ref!r} cannot be resolved (use a reference inside the schema, e.g. #/$defs/Name)"))
    return problems


def _references(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield (*path, key), value
            elif key not in _DATA_KEYWORDS or (path and path[-1] in _NAMING_KEYWORDS):
                yield from _references(value, (*path, key))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _references(item, (*path, i))


def _path(parts: Sequence[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")

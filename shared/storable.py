"""What JSON the stores can hold: the checks every way in (API, flows.yaml) applies to parameters."""

from __future__ import annotations

from typing import Any

# Containers nested in ``parameters``, the object itself included. Deeper
# documents cannot be rendered back (the serializer stops near 255 levels).
MAX_PARAMETERS_DEPTH = 32


def json_problem(value: Any, root: str, max_depth: int = MAX_PARAMETERS_DEPTH) -> str | None:
    """What makes a parsed JSON value unstorable, or None; ``root`` names it in the message.

    Rejected: nesting deeper than ``max_depth``, the NUL character in a string
    or key (PostgreSQL text and jsonb cannot hold it) and lone UTF-16 surrogates
    such as ``"\\ud800"`` (not Unicode). Walks iteratively: no recursion limit.
    """
    stack: list[tuple[Any, str, int]] = [(value, root, 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            problem = _string_problem(item)
            if problem:
                return f"{problem} (at {path})"
            continue
        if isinstance(item, dict):
            children = [(v, f"{path}.{_clip(k) if isinstance(k, str) else k}", k) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(v, f"{path}[{i}]", None) for i, v in enumerate(item)]
        else:
            continue
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels (at {path})"
        for child, child_path, key in children:
            if isinstance(key, str):
                problem = _string_problem(key)
                if problem:
                    return f"{problem} (in a key at {child_path})"
            stack.append((child, child_path, depth + 1))
    return None


def _string_problem(text: str) -> str | None:
    if "\x00" in text:
        return "strings cannot contain the NUL character \\u0000"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "strings cannot contain lone UTF-16 surrogates such as \\ud800"
    return None


def _clip(text: str, width: int = 40) -> str:
    # The key goes into the error message: a lone surrogate in it would make the answer unencodable.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= width else text[:width] + "…"

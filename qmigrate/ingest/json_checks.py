"""Checks of raw JSON before a request is parsed (pure): nesting depth and valid Unicode of a
decoded value, integer and id-list tests that cost no Python step per id, and the readable
request id of a JSONL line that was refused as JSON."""

from __future__ import annotations

import json
import math
import re

from qmigrate.wire import protocol as P

MAX_JSON_DEPTH = 32


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def check_json(obj) -> None:
    """Raise ValueError for a decoded JSON value nested deeper than MAX_JSON_DEPTH or holding
    a string that is not valid Unicode (a lone surrogate from a \\ud800 escape). Iterative:
    a deep value cannot exhaust the stack here. A list's numbers are skipped by type in C: a
    prompt of token ids costs no Python step per id."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate (not valid Unicode)") from None
        elif isinstance(value, dict):
            stack.extend((k, depth + 1) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list) and value:
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
            if not _SCALARS.issuperset(map(type, value)):
                stack.extend((v, depth + 1) for v in value if type(v) not in _SCALARS)


_SCALARS = frozenset((int, float, bool, type(None)))
_INT = frozenset((int,))


def is_int_list(value: list) -> bool:
    """Every item an int and none a bool (an id list), checked in C."""
    return _INT.issuperset(map(type, value))


# A JSON string, or one structural character: enough to walk an object's top level in C
# without decoding (or recursing into) its values.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[][{},:]')


def readable_id(line: str) -> str | None:
    """The top-level "id" of a JSONL line that json.loads or check_json refused for something
    elsewhere in it (a lone surrogate, NaN, nesting past 32 levels, an integer past Python's
    4,300 digits), when that id on its own is one parse_line would take; else None. The line is
    walked token by token, so a value nested 100,000 deep costs no recursion."""
    if not line.lstrip().startswith("{"):
        return None
    depth, key, value_at, found = 0, None, None, None
    expect_key = False
    for m in _JSON_TOKEN.finditer(line):
        t = m.group()
        if depth == 1 and t in ",}" and key == '"id"' and value_at is not None:
            found = _id_value(line[value_at:m.start()])
        if t == "{" or t == "[":
            depth += 1
            expect_key = depth == 1
        elif t == "}" or t == "]":
            depth -= 1
            if depth <= 0:
                break
        elif depth == 1:
            if t == ",":
                expect_key, key, value_at = True, None, None
            elif t == ":":
                value_at = m.end()
            elif expect_key:
                key, expect_key = t, False
    return found


def _id_value(text: str) -> str | None:
    try:
        value = json.loads(text, parse_constant=reject_constant)
    except ValueError:
        return None
    if is_int(value):
        value = str(value)
    if not isinstance(value, str) or not value or len(value) > P.MAX_REQ_ID:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value

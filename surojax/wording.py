"""How error messages name what they found, so that each message builds the phrase the same (grammatical) way.

- `a_type(value)`: the value's Python type with its article ("an int", "a list"; None is "null"), for "must be a
  string, found an int".
- `json_type(value)`: the JSON kind of a parsed value ("an array", "an object", "a number", "null").
- `json_error(e)`: a `json.JSONDecodeError` as "<what> at line L column C" (Python's messages for an unterminated
  string or a control character already end in "at", which must not become "at at").

No surojax imports: every layer may use it.
"""
from __future__ import annotations

import json

_VOWEL_SOUND = tuple("aeiouAEIOU")


def with_article(noun: str) -> str:
    """'int' -> 'an int', 'list' -> 'a list' (by the first letter: type names, not spoken words)."""
    return f"{'an' if noun.startswith(_VOWEL_SOUND) else 'a'} {noun}"


def a_type(value: object) -> str:
    """The value's type for a message: 'an int', 'a float', 'a list', 'a dict'; None -> 'null'."""
    return "null" if value is None else with_article(type(value).__name__)


def json_type(value: object) -> str:
    """A value json.loads made, by its JSON kind: 'an object', 'an array', 'a string', 'a number', 'a boolean',
    'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return a_type(value)


def json_error(e: json.JSONDecodeError, *, line: bool = True) -> str:
    """'Expecting value at line 1 column 5'; line=False: the column only (one JSON line of a .jsonl file)."""
    where = f"line {e.lineno} column {e.colno}" if line else f"column {e.colno}"
    msg = e.msg.rstrip()
    return f"{msg} {where}" if msg.endswith(" at") else f"{msg} at {where}"

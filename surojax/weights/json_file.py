"""Reading one JSON-object file (config.json, adapter_config.json, generation_config.json ...) with every failure a
named, user-facing error.

    cfg = read_json_object(path, ModelRefError)   # dict, or ModelRefError("<path>: expected ..., found ...")

A missing or unreadable file, bytes that are not UTF-8, text that is not JSON, JSON nested deeper than the parser
recurses, and JSON that is not an object all raise `error` (a ValueError subclass with is_user_error = True)
naming the file and what was expected vs found. The file is read whole: callers point it at small config files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from surojax.wording import json_error, json_type


def read_json_object(path: str | os.PathLike, error: type[ValueError]) -> dict:
    """The JSON object in `path`; any failure raises `error` (module docstring)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: expected UTF-8 text, found byte {e.object[e.start]:#04x} at offset {e.start}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: expected a JSON object, found text that is not valid JSON ({json_error(e)})"
                    ) from None
    except RecursionError:
        raise error(f"{path}: expected a JSON object, found nesting deeper than the parser allows") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found {json_type(data)}")
    return data

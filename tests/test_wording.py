"""Message phrases (surojax/wording.py) and the messages built with them: "an int", not "a int"; a JSON error's
position without "at at" (Python's own messages for an unterminated string end in "at")."""
import json
from pathlib import Path

import pytest

from surojax.data.formats import make_formatter
from surojax.data.sources import InvalidRowError
from surojax.config.data import DatasetSpec
from surojax.data.tokenizer import Tokenizer
from surojax.wording import a_type, json_error, json_type


def decode_error(text: str) -> json.JSONDecodeError:
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text)
    return e.value


def test_phrases():
    assert [a_type(v) for v in (1, 1.5, "x", [1], {}, None, True)] == [
        "an int", "a float", "a str", "a list", "a dict", "null", "a bool"]
    assert [json_type(v) for v in (1, 1.5, "x", [1], {}, None, True)] == [
        "a number", "a number", "a string", "an array", "an object", "null", "a boolean"]
    unterminated = decode_error('{"text": "abc')
    assert unterminated.msg.endswith(" at")  # Python's wording, which the helper must not double
    assert json_error(unterminated) == "Unterminated string starting at line 1 column 10"
    assert json_error(unterminated, line=False) == "Unterminated string starting at column 10"
    assert json_error(decode_error('{"a" 1}'), line=False) == "Expecting ':' delimiter at column 6"


def test_row_messages_use_the_article():
    tok = Tokenizer.from_dir(Path(__file__).parent / "fixtures" / "tokenizer")
    with pytest.raises(InvalidRowError, match="must be a string, found an int"):
        make_formatter("text", tok, DatasetSpec(path="rows.jsonl"))({"text": 5})

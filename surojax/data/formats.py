"""Dataset formats: one row -> an `Example` (token ids + a per-token supervised mask).

    text          a `text_field` string; all tokens supervised; encoded with the tokenizer's own special tokens
                  (BOS where its post-processor adds one) and EOS appended, so documents end visibly.
    instruction   alpaca {instruction, input, output} (or TRL-style {prompt, completion}). With a chat template
                  it is rendered as user -> assistant; without one as the plain alpaca prompt
                  "### Instruction:\\n...\\n\\n### Input:\\n...\\n\\n### Response:\\n" + output + EOS.
    conversation  OpenAI `messages` [{role, content}] or sharegpt `conversations` [{from: human|gpt|system, value}],
                  rendered with the chat template (assistant turns located by chat_masks).
    auto          the type chosen from the first row's columns (the choice and the reason are logged).

Only assistant / output tokens are supervised unless train_on_inputs. `fit_pieces` fits an example longer than
the length limit: truncated at the end or the start, dropped, or split into pieces (the config's
truncation_strategy). An instruction dataset's prompt_format writes the user turn; system_field names a column of
per-row system prompts; message_property_mappings renames message keys; tools_field is the tools column. A row
that cannot be formatted raises `InvalidRowError`. The column names and the system prompt come from the dataset's
entry, `surojax.config.data.DatasetSpec` (its *_field keys).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from surojax.config.data import TEMPLATE_FAMILIES, DatasetSpec, DatasetType
from surojax.data.chat_masks import chat_ids_and_mask
from surojax.data.chat_roles import role_problem
from surojax.data.sources import DataError, InvalidRowError
from surojax.data.tokenizer import ChatTemplateError, Tokenizer, compile_chat_template
from surojax.wording import a_type

log = logging.getLogger(__name__)

TYPES = get_args(DatasetType)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "bot": "assistant", "chatgpt": "assistant", "system": "system", "tool": "tool",
                  "function": "tool", "observation": "tool", "function_response": "tool",
                  "developer": "developer"}


@dataclass(frozen=True)
class Example:
    """One tokenized example: mask[t] is True where ids[t] is supervised (batch.example_to_row's convention)."""

    ids: np.ndarray   # [L] int32
    mask: np.ndarray  # [L] bool

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def of(ids, mask) -> "Example":
        return Example(np.asarray(ids, np.int32), np.asarray(mask, bool))


def detect_type(row: Mapping[str, Any], spec: DatasetSpec) -> tuple[str, str]:
    """(type, reason) for a row's columns, in the order conversation, preference, instruction, text."""
    cols = sorted(row)
    if isinstance(row.get(spec.messages_field), (list, str)):
        return "conversation", f"column {spec.messages_field!r} holds chat messages"
    if isinstance(row.get("conversations"), (list, str)):
        return "conversation", "column 'conversations' holds sharegpt turns"
    if spec.chosen_field in row and spec.rejected_field in row:
        return "preference", f"columns {spec.chosen_field!r} and {spec.rejected_field!r}"
    if spec.instruction_field in row and spec.output_field in row:
        return "instruction", f"columns {spec.instruction_field!r} and {spec.output_field!r}"
    if "prompt" in row and "completion" in row:
        return "instruction", "columns 'prompt' and 'completion'"
    if isinstance(row.get(spec.text_field), str):
        return "text", f"column {spec.text_field!r} holds text"
    raise DataError(f"type: auto cannot tell the format from the columns {cols}: expected {spec.messages_field!r} "
                    f"or 'conversations' (conversation), {spec.instruction_field!r} + {spec.output_field!r} "
                    f"(instruction) or {spec.text_field!r} (text); set `type:` and the *_field keys")


def make_formatter(kind: str, tokenizer: Tokenizer, spec: DatasetSpec, *,
                   train_on_inputs: bool = False, chat_template: str | None = None, use_chat_template: bool = True,
                   template_family: str | None = None) -> Callable[[Mapping[str, Any]], Example]:
    """A function row -> Example for a resolved type (not auto). Set-up errors raise `DataError` here.
    `use_chat_template` False renders instruction rows without the template (and refuses conversations);
    `template_family` (the config's `template:`) checks that the tokenizer's template is of that family."""
    if kind == "preference":
        raise DataError("type: preference holds chosen/rejected pairs: train them with trainer: dpo (`surojax dpo`, "
                        "surojax/data/preference.py); the SFT / pretraining data pipeline takes text, instruction or "
                        "conversation")
    if kind == "conversation" and not use_chat_template:
        raise DataError(f"{spec.path}: conversation rows are rendered with a chat template, and use_chat_template "
                        "is false: remove it, or use instruction / text data")
    if template_family is not None and kind != "text":
        check_template_family(tokenizer, template_family, chat_template)
    template = None if not use_chat_template else _chat_template(tokenizer, chat_template,
                                                                 required=(kind == "conversation"))
    if kind == "text":
        return lambda row: _text(row, tokenizer, spec)
    if kind == "instruction":
        return lambda row: _instruction(row, tokenizer, spec, template, train_on_inputs)
    if kind == "conversation":
        return lambda row: _conversation(row, tokenizer, spec, template, train_on_inputs)
    raise DataError(f"unknown dataset type {kind!r} (expected one of {', '.join(TYPES)})")


def check_template_family(tokenizer: Tokenizer, family: str, chat_template: str | None = None) -> None:
    """`template: family` (Surogate's names, config.data.TEMPLATE_FAMILIES): the template in use must hold the
    family's marker (ChatML's <|im_start|>, Llama 3's <|start_header_id|>, ...)."""
    try:
        text = tokenizer.get_chat_template(chat_template)
    except ChatTemplateError as e:
        raise DataError(f"template: {family}: {e}") from None
    if TEMPLATE_FAMILIES[family] not in text:
        raise DataError(f"template: {family}: the tokenizer's chat template ({tokenizer.source}) is not a {family} "
                        f"template (it has no {TEMPLATE_FAMILIES[family]}); remove the key to use it, or give the "
                        "template's text or file as chat_template")


def _chat_template(tokenizer: Tokenizer, chat_template: str | None, required: bool) -> str | None:
    """The template text to use (compiled once here, so that a broken template fails before any row)."""
    try:
        text = tokenizer.get_chat_template(chat_template)
    except ChatTemplateError as e:
        if required:
            raise DataError(f"type: conversation needs a chat template: {e}") from None
        return None
    try:
        compile_chat_template(text)
    except Exception as e:  # noqa: BLE001 - jinja raises several kinds
        raise DataError(f"the chat template does not compile: {e}") from None
    return text


def _text_value(row: Mapping, key: str, what: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        found = "missing" if key not in row else a_type(value)
        raise InvalidRowError(f"{what} field {key!r} must be a string, found {found} (columns: {sorted(row)})")
    return value


def _text(row, tokenizer: Tokenizer, spec: DatasetSpec) -> Example:
    text = _text_value(row, spec.text_field, "text")
    if not text.strip():
        raise InvalidRowError(f"empty text in field {spec.text_field!r}")
    ids = tokenizer.encode(text, add_special_tokens=True)
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return Example.of(ids, [True] * len(ids))


def _instruction(row, tokenizer: Tokenizer, spec: DatasetSpec, template: str | None, train_on_inputs: bool):
    if spec.instruction_field not in row and "prompt" in row and "completion" in row:
        instruction, inp, output = _text_value(row, "prompt", "prompt"), "", _text_value(row, "completion", "completion")
    else:
        instruction = _text_value(row, spec.instruction_field, "instruction")
        inp = _text_value(row, spec.input_field, "input", required=False) if spec.input_field else ""
        output = _text_value(row, spec.output_field, "output")
    if not output.strip():
        raise InvalidRowError(f"empty output in field {spec.output_field!r}")
    system = _row_system(row, spec.system_field or "system") or spec.system_prompt
    user = _user_turn(spec, instruction, inp)
    if template is not None:
        user = instruction + ("\n\n" + inp if inp.strip() else "") if user is None else user
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": output}]
        ids, mask = chat_ids_and_mask(messages, tokenizer, chat_template=template, train_on_inputs=train_on_inputs)
        return Example.of(ids, mask)
    if user is not None:  # the dataset's own prompt format: the prompt is that text, then the output
        prompt = (system + "\n\n" if system else "") + user
    else:
        prompt = (system + "\n\n" if system else "") + f"### Instruction:\n{instruction}\n\n"
        if inp.strip():
            prompt += f"### Input:\n{inp}\n\n"
        prompt += "### Response:\n"
    p_ids = tokenizer.encode(prompt, add_special_tokens=True)
    o_ids = tokenizer.encode(output) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return Example.of(p_ids + o_ids, [train_on_inputs] * len(p_ids) + [True] * len(o_ids))


def _row_system(row: Mapping, field: str) -> str | None:
    """The row's own system prompt in `field` (a non-empty string), else None."""
    value = row.get(field)
    return value if isinstance(value, str) and value else None


def _user_turn(spec: DatasetSpec, instruction: str, inp: str) -> str | None:
    """The user turn written by the dataset's prompt_format / prompt_format_no_input, None when it sets neither."""
    if inp.strip():
        fmt = spec.prompt_format
    else:  # Surogate's default for rows without input once a prompt_format is given: the instruction alone
        fmt = spec.prompt_format_no_input or ("{instruction}" if spec.prompt_format else None)
    return None if fmt is None else fmt.format(instruction=instruction, input=inp)


IMAGE_ROWS_HINT = ("rows with images are tokenized with their pixels by surojax/data/image_rows.py (a vision-language "
                   "model's data path); the text pipeline does not drop the images silently")


def _messages(row, spec: DatasetSpec, keep_parts: bool = False) -> list[dict]:
    """The row's messages (role / content), sharegpt turns converted; list contents joined into their text, or
    with `keep_parts` kept as parts (image rows: surojax/data/image_rows.py)."""
    raw, sharegpt = row.get(spec.messages_field), False
    if raw is None and row.get("conversations") is not None:
        raw, sharegpt = row["conversations"], True
    if isinstance(raw, str):  # CSV and some parquet exports store the list as JSON text
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise InvalidRowError(f"field {spec.messages_field!r} is a string that is not a JSON list") from None
    if not isinstance(raw, list) or not raw:
        raise InvalidRowError(f"expected a non-empty list of messages in {spec.messages_field!r} or "
                              f"'conversations' (columns: {sorted(row)})")
    out = []
    renamed = {theirs: ours for ours, theirs in (spec.message_property_mappings or {}).items() if theirs != ours}
    for j, m in enumerate(raw):
        if not isinstance(m, Mapping):
            raise InvalidRowError(f"message {j} is {a_type(m)}, not an object")
        m = {renamed.get(k, k): v for k, v in m.items() if v is not None}  # parquet fills absent fields with None
        if "from" in m and "role" not in m:
            sharegpt = True
        if sharegpt:
            role = SHAREGPT_ROLES.get(str(m.get("from", m.get("role"))).lower())
            if role is None:
                raise InvalidRowError(f"message {j}: unknown sharegpt role {m.get('from')!r} (one of "
                                      f"{', '.join(SHAREGPT_ROLES)})")
            m = {"role": role, "content": m.get("value", m.get("content"))}
        if (problem := role_problem(m)) is not None:
            raise InvalidRowError(f"message {j} {problem}")
        content = m.get("content")
        if isinstance(content, list) and not keep_parts:  # OpenAI content parts: keep the text ones
            if any(isinstance(p, Mapping) and p.get("type") in ("image", "image_url") for p in content):
                raise InvalidRowError(f"message {j} has image parts: {IMAGE_ROWS_HINT}")
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        elif content is None and not m.get("tool_calls"):
            raise InvalidRowError(f"message {j} ({m['role']}) has no content")
        out.append(m)
    system = (_row_system(row, spec.system_field) if spec.system_field else None) or spec.system_prompt
    if system and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system})
    return out


def conversation_and_tools(row, spec: DatasetSpec, train_on_inputs: bool, keep_parts: bool = False
                           ) -> tuple[list[dict], list | None]:
    """A conversation row's messages (`_messages`) and tools, refusing a conversation with nothing to learn."""
    messages = _messages(row, spec, keep_parts=keep_parts)
    if not train_on_inputs and not any(m["role"] == "assistant" for m in messages):
        raise InvalidRowError("no assistant message: nothing to learn from this conversation")
    tools = row.get(spec.tools_field) if spec.tools_field else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) or None
        except json.JSONDecodeError:
            raise InvalidRowError(f"field {spec.tools_field!r} is a string that is not JSON") from None
    return messages, tools or None


def _conversation(row, tokenizer: Tokenizer, spec: DatasetSpec, template: str, train_on_inputs: bool) -> Example:
    if row.get("images"):
        raise InvalidRowError(f"the row has an 'images' column: {IMAGE_ROWS_HINT}")
    messages, tools = conversation_and_tools(row, spec, train_on_inputs)
    ids, mask = chat_ids_and_mask(messages, tokenizer, tools=tools, chat_template=template,
                                  train_on_inputs=train_on_inputs)
    return Example.of(ids, mask)


TRUNCATION_MODES = ("truncate", "drop", "left", "split")


def fit_length(ex: Example, sequence_len: int, mode: str = "truncate") -> Example | None:
    """`ex` if it fits, else its first sequence_len tokens (mode "truncate"), its last ones ("left") or None
    ("drop"). Mode "split" cuts it into pieces: see `fit_pieces`."""
    if len(ex) <= sequence_len:
        return ex
    if mode == "drop":
        return None
    if mode == "left":
        return Example(ex.ids[-sequence_len:], ex.mask[-sequence_len:])
    if mode != "truncate":
        raise ValueError(f"truncation mode must be one of {', '.join(TRUNCATION_MODES[:3])}, got {mode!r}")
    return Example(ex.ids[:sequence_len], ex.mask[:sequence_len])


def fit_pieces(ex: Example, sequence_len: int, mode: str = "truncate") -> list[Example]:
    """The examples `ex` becomes at `sequence_len`: itself, its cut (fit_length), none, or with mode "split" its
    consecutive pieces of sequence_len tokens (the last one shorter)."""
    if mode != "split" or len(ex) <= sequence_len:
        fitted = fit_length(ex, sequence_len, mode)
        return [] if fitted is None else [fitted]
    return [Example(ex.ids[i:i + sequence_len], ex.mask[i:i + sequence_len])
            for i in range(0, len(ex), sequence_len)]


def supervised_targets(ex: Example) -> int:
    """Tokens that carry loss as targets (the first token is never a target)."""
    return int(ex.mask[1:].sum())

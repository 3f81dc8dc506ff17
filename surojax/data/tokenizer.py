"""Tokenizer + chat template, read from a Hugging Face tokenizer directory, with the ids transformers gives.

Files read (the layout `save_pretrained` writes):
    tokenizer.json          the `tokenizers` serialization: the whole encode/decode pipeline (required)
    tokenizer_config.json   special tokens (strings or AddedToken dicts), added_tokens_decoder, chat_template
                            (a string, or a list of {"name", "template"}), clean_up_tokenization_spaces ...
    chat_template.jinja     newer transformers save the template here; it wins over tokenizer_config.json
    additional_chat_templates/<name>.jinja   further named templates
    special_tokens_map.json legacy, read only for special tokens tokenizer_config.json does not name

Loading replays what transformers 5 does to the backend after reading tokenizer.json (so that `encode` gives
transformers' ids): named and extra special tokens missing from the added tokens are added as special tokens,
`split_special_tokens` is applied, and truncation / padding stored in tokenizer.json are turned off (transformers
turns them off for every call that does not ask for them). What `encode(add_special_tokens=True)` adds is decided
by tokenizer.json's post-processor alone: transformers 5 drops tokenizer_config.json's add_bos_token /
add_eos_token whenever tokenizer.json exists, and so does this class.

The chat template is rendered the way `transformers.utils.chat_template_utils` renders it: an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls; `raise_exception`,
`strftime_now` and a `tojson` filter that is plain `json.dumps` (no HTML escaping, non-ASCII kept); the
`{% generation %}` tag marking assistant text; the named special tokens (bos_token, eos_token ...) and any extra
keyword arguments as template variables; `tools` and `documents` always defined (None when not given).
Pitfall: a template sees `bos_token` as text, so a template that writes it already gives the BOS id; never
encode the rendered text with add_special_tokens=True (that would add a second BOS).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
import tokenizers

from surojax.data.chat_roles import for_template
from surojax.wording import json_type

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
_TRACKER_VAR = "__surojax_generation_tracker"


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded, or a request the tokenizer cannot serve."""

    is_user_error = True


class ChatTemplateError(TokenizerError):
    """No chat template, a template that does not compile, or a template that rejected the conversation."""


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, special: bool = True) -> tokenizers.AddedToken:
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=special, normalized=False)
    flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
    return tokenizers.AddedToken(value["content"], special=value.get("special", special), **flags)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TokenizerError(f"cannot read {path}: expected a UTF-8 JSON object, found {type(e).__name__}: {e}"
                             ) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, found {json_type(data)}")
    return data


# ---------------------------------------------------------------------------------------------------------------
# Chat template rendering
# ---------------------------------------------------------------------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records the body's character span.

    The span's start is the length of everything rendered so far, which only the consumer of
    `template.generate()` knows; the tracker holding those blocks is passed in as a template variable.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_track", [jinja2.nodes.Name(_TRACKER_VAR, "load")])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _track(tracker, caller):
        text = caller()
        if isinstance(tracker, dict):
            start = sum(map(len, tracker["blocks"]))
            tracker["spans"].append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: json.dumps as is (jinja's own tojson HTML-escapes <, >, &, ' and sorts keys).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' jinja environment (cached by template text)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(template: str, messages: Sequence[Mapping], *, tools=None, documents=None,
                         add_generation_prompt: bool = False, **variables) -> tuple[str, list[tuple[int, int]]]:
    """Render one conversation. Returns the text and the character spans of `{% generation %}` blocks.

    Raises jinja2 errors as they come (TemplateSyntaxError, or TemplateError from `raise_exception`);
    `Tokenizer.apply_chat_template` turns them into ChatTemplateError.
    """
    compiled = compile_chat_template(template)
    tracker = {"blocks": [], "spans": []}
    for block in compiled.generate(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables,
                                   **{_TRACKER_VAR: tracker}):
        tracker["blocks"].append(block)
    return "".join(tracker["blocks"]), tracker["spans"]


def _load_chat_templates(directory: Path, config: dict) -> tuple[str | dict[str, str] | None, str | None]:
    """The template(s) and the file they came from, with transformers' precedence (.jinja files win)."""
    templates, origin = {}, None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"], origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
            origin = origin or str(extra_dir)
    if templates:
        return (templates["default"] if list(templates) == ["default"] else templates), origin
    value = config.get("chat_template")
    where = str(directory / "tokenizer_config.json")
    if value is None or isinstance(value, str):
        return value, (where if value is not None else None)
    if isinstance(value, list) and all(isinstance(t, Mapping) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: t["template"] for t in value}, where
    raise TokenizerError(f"{where}: 'chat_template' must be a string or a list of {{'name', 'template'}} objects")


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template(s) of a Hugging Face tokenizer dir."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | Mapping[str, str] | None = None, source: str = "<in memory>",
                 chat_template_source: str | None = None):
        config = dict(config or {})
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        self._chat_template_source = chat_template_source or source
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))

        # Named special tokens (bos_token ...) and model-specific named ones (image_token ...): template variables.
        self.special_tokens: dict[str, str] = {}
        for key, value in config.items():
            content = _token_content(value) if key.endswith("_token") else None
            if content is not None:
                self.special_tokens[key] = content
        for key in ("extra_special_tokens", "model_specific_special_tokens"):
            if isinstance(config.get(key), Mapping):
                self.special_tokens.update({k: c for k, v in config[key].items() if (c := _token_content(v))})
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        extra = list(extra) if isinstance(extra, (list, tuple)) else []

        # Replay what transformers does to the backend on load (module docstring).
        backend.no_truncation()
        backend.no_padding()
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        for _, tok in sorted(((int(i), t) for i, t in (config.get("added_tokens_decoder") or {}).items())):
            if tok["content"] not in present:
                backend.add_tokens([_added_token(tok, special=bool(tok.get("special")))])
                present.add(tok["content"])
        specials = [config[k] for k in self.special_tokens if _token_content(config.get(k))] + extra
        backend.add_special_tokens([_added_token(v) for v in specials if _token_content(v) is not None])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    # -- loading --------------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory {directory} does not exist")
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{tok_file} not found: surojax reads the fast-tokenizer file tokenizer.json only (a directory with "
                "only tokenizer.model / vocab.json + merges.txt can be converted once with transformers: "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON or unknown components
            raise TokenizerError(f"cannot load {tok_file}: {e}") from e
        cfg_file = directory / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        legacy = directory / "special_tokens_map.json"
        if legacy.is_file() and "added_tokens_decoder" not in config:
            # Older saves: transformers lets special_tokens_map.json override tokenizer_config.json here.
            for key, value in _read_json(legacy).items():
                if key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                    known = config.get("extra_special_tokens", config.get("additional_special_tokens"))
                    known = list(known) if isinstance(known, list) else []
                    config["extra_special_tokens"] = known + [v for v in value if v not in known]
                else:
                    config[key] = value
        template, template_source = _load_chat_templates(directory, config)
        return cls(backend, config, template, source=str(directory), chat_template_source=template_source)

    # -- vocabulary -----------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included (transformers' len(tokenizer), not .vocab_size)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    bos_token = property(lambda self: self.special_tokens.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens.get("eos_token"))
    pad_token = property(lambda self: self.special_tokens.get("pad_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of every added token flagged special (those `decode(skip_special_tokens=True)` drops)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # -- text <-> ids ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        # transformers skips this clean-up for BPE models, where it would delete real spaces before punctuation.
        is_bpe = type(self.backend.model).__name__ == "BPE"
        if self._clean_up_spaces and (not is_bpe or self._clean_up_bpe):
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    # -- chat -----------------------------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template text: `chat_template` may be a template or the name of one (transformers' rules)."""
        if isinstance(self.chat_template, Mapping):
            if chat_template is not None and chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.chat_template:
                    return self.chat_template["tool_use"]
                if "default" in self.chat_template:
                    return self.chat_template["default"]
                raise ChatTemplateError(
                    f"{self._chat_template_source} has several chat templates and none is named 'default'; pass "
                    f"chat_template= one of {sorted(self.chat_template)}")
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ChatTemplateError(
                f"the tokenizer in {self.source} has no chat template (neither tokenizer_config.json "
                "'chat_template' nor chat_template.jinja); pass chat_template=TEXT, or use a dataset format that "
                "does not need one")
        return self.chat_template

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = False, tools=None,
                            tokenize: bool = True, *, chat_template: str | None = None, documents=None,
                            continue_final_message: bool | str = False, return_assistant_mask: bool = False,
                            **kwargs):
        """Render `messages` and (tokenize=True) encode them without adding special tokens.

        Returns text (tokenize=False), ids, or with return_assistant_mask=True a dict {"input_ids",
        "assistant_mask"} where the mask is 1 on tokens inside the template's `{% generation %}` blocks
        (transformers' return_assistant_tokens_mask). Extra keyword arguments become template variables
        (e.g. enable_thinking=False) and override the special-token variables. A `developer` message reaches a
        template that does not name that role as a `system` message (surojax/data/chat_roles.py).
        """
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        if continue_final_message and return_assistant_mask:
            raise ChatTemplateError("continue_final_message cannot be combined with return_assistant_mask")
        if return_assistant_mask and not tokenize:
            raise ChatTemplateError("return_assistant_mask needs tokenize=True")
        template = self.get_chat_template(chat_template, tools)
        messages = for_template(messages, template)  # OpenAI's `developer` as `system` where the template lacks it
        if tools is not None:
            tools = list(tools)
            if not all(isinstance(t, Mapping) for t in tools):
                raise ChatTemplateError("tools must be JSON-schema dicts ({'type': 'function', 'function': {...}})")

        final = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            messages, final = self._mark_final_message(messages, field, template)
        variables = {**self.special_tokens, **kwargs}
        try:
            text, spans = render_chat_template(template, messages, tools=tools, documents=documents,
                                               add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template from {self._chat_template_source} does not compile: "
                                    f"{e.message} (template line {e.lineno})") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template from {self._chat_template_source} rejected the conversation: "
                                    f"{e}") from e
        if final is not None:
            text = self._cut_at_final_message(text, final)
        if not tokenize:
            return text
        if not return_assistant_mask:
            return self.encode(text)
        enc = self.backend.encode(text, add_special_tokens=False)
        mask = [0] * len(enc.ids)
        for start, end in spans:  # token range from the first to the last character of each span
            first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
            if first is None:
                break
            for t in range(first, last + 1 if last is not None else len(mask)):
                mask[t] = 1
        return {"input_ids": enc.ids, "assistant_mask": mask}

    @staticmethod
    def _mark_final_message(messages, field: str, template: str):
        """transformers' continue_final_message: tag the end of the last message so the text can be cut there."""
        messages = copy.deepcopy(list(messages))
        final = messages[-1].get(field)
        if final is None:
            raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}"')
        if field not in template:
            raise ChatTemplateError(f'continue_final_message is set to "{field}", which the chat template never uses')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatTemplateError("continue_final_message is set but the final message has no text block")
        else:
            messages[-1][field] = final + _CONTINUE_TAG
        return messages, final

    @staticmethod
    def _cut_at_final_message(text: str, final: str) -> str:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError("continue_final_message is set but the chat template dropped or changed the "
                                    "final message, so the text cannot be cut where it ends")
        at = text.rindex(_CONTINUE_TAG.strip())
        if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed trailing spaces of the message

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, pad={self.pad_token!r}, chat_template={self.chat_template is not None})")

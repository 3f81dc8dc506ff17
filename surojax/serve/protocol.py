"""OpenAI request bodies (pydantic) and the conversion to engine `SamplingParams`.

Unknown fields are accepted and ignored (clients send vendor extras); values are range-checked by
`SamplingParams.validate`, whose message becomes the 400 error. vLLM's extras are understood: top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens, chat_template_kwargs, and prompt_logprobs on
completions. `n` > 1 and `echo` are served by the HTTP layer (api_server); `tools` / `tool_choice` by `tool_parsers`.

Structured output: ``response_format`` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
"schema", "strict"}}) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``, at most one of them,
become ``SamplingParams.grammar`` (``_Sampling.grammar``; the grammar itself is checked against the tokenizer
by the HTTP layer before the request is queued).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from surojax.generation.sampling import SamplingParams, SamplingParamsError
from surojax.serve.guided import (GrammarError, grammar_from_choice, grammar_from_json_object,
                                  grammar_from_json_schema, grammar_from_regex)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` would shadow pydantic's
    strict: bool | None = None  # the schema is enforced either way (as vLLM does)


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Base):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1  # independent samples of each prompt (engine requests; seeds seed, seed + 1, ... when seeded)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def grammar(self) -> tuple[str, str] | None:
        """(the request field it came from, llguidance grammar text), or None without structured output.
        Raises SamplingParamsError naming the field (several given; a schema that is not a JSON object ...)."""
        given = [(name, getattr(self, name)) for name in ("guided_json", "guided_regex", "guided_choice")
                 if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given.append(("response_format", rf))
        if not given:
            return None
        if len(given) > 1:
            raise SamplingParamsError(f"give at most one of response_format, guided_json, guided_regex, "
                                      f"guided_choice (got {', '.join(n for n, _ in given)})", given[1][0])
        param, value = given[0]
        try:
            if param == "guided_json":
                return param, grammar_from_json_schema(value)
            if param == "guided_regex":
                return param, grammar_from_regex(value)
            if param == "guided_choice":
                return param, grammar_from_choice(value)
            if value.type == "json_object":
                return param, grammar_from_json_object()
            if value.json_schema is None or value.json_schema.schema_ is None:
                raise GrammarError('response_format {"type": "json_schema"} needs json_schema.schema')
            return param, grammar_from_json_schema(value.json_schema.schema_)
        except GrammarError as e:
            raise SamplingParamsError(f"{param}: {e}", param) from None

    def sampling_params(self, *, max_tokens: int, eos_ids: tuple[int, ...], logprobs: bool,
                        top_logprobs: int, grammar: str | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}", "n")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        stop_ids = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else tuple(eos_ids))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else float(self.top_p),
            min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop_token_ids=tuple(dict.fromkeys(stop_ids)), stop=stop, logprobs=logprobs,
            top_logprobs=top_logprobs, grammar=grammar, prompt_logprobs=prompt_logprobs)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: tool_choice "required" forces exactly one call
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the choice's prompt_logprobs, with this many alternatives

    def prompt_scores(self) -> int | None:
        """How many alternatives per prompt position the engine computes (None: the prompt is not scored): for
        echo with logprobs (the prompt's tokens join the logprobs object), prompt_logprobs, and echo with
        max_tokens 0 (the prompt alone: it is run through the model, nothing is generated)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        if asked:
            return max(asked)
        return 0 if self.max_tokens == 0 and self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated: a list of one kind (ints here), no per-token pass needed
            return [list(p)]
        return list(p)


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(_Base):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Base):
    lora_name: str

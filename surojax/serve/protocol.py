"""OpenAI request bodies (pydantic) and the conversion to engine `SamplingParams`.

Unknown fields are accepted and ignored (clients send vendor extras); values are range-checked by
`SamplingParams.validate`, whose message becomes the 400 error. vLLM's extras are understood: top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens, chat_template_kwargs. `n` > 1 and `echo` are
served by the HTTP layer (api_server); `tools` / `tool_choice` by `tool_parsers`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from surojax.generation.sampling import SamplingParams, SamplingParamsError


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False


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

    def sampling_params(self, *, max_tokens: int, eos_ids: tuple[int, ...], logprobs: bool,
                        top_logprobs: int) -> SamplingParams:
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
            top_logprobs=top_logprobs)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
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

"""Token ids and the supervised-token mask of one conversation, from any chat template.

We do not rely on `{% generation %}` markers (few templates have them). For each assistant message i we
render two prefixes of the conversation:

    before_i = render(messages[:i], add_generation_prompt=True)    ... "<|im_start|>assistant\\n"
    after_i  = render(messages[:i + 1])                            ... "<|im_start|>assistant\\nHi!<|im_end|>\\n"

and take the tokens between them as the assistant's turn. This holds only if every rendering is a prefix of
the full rendering (a template that rewrites earlier turns once a later one exists, e.g. one that drops the
reasoning of all but the last assistant turn, breaks it); we check it on the token ids and raise a
`ChatMaskError` naming the turn and showing where the texts diverge.

Inside the turn, everything up to and including the last end-of-turn token (eos, <|im_end|>, <|eot_id|>,
<end_of_turn> ...) is supervised: the model must learn to stop. What the template writes after it (the "\\n"
that separates turns) is not, nor is the header that `add_generation_prompt` writes (the model never
generates it). With train_on_inputs every token is supervised.

Cost: each assistant turn renders and encodes two prefixes, O(turns²) text per conversation; fine for SFT data.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

from surojax.data.sources import InvalidRowError
from surojax.data.tokenizer import ChatTemplateError, Tokenizer

# End-of-turn markers of common templates; whichever of them the tokenizer has as a single token counts.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                      "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|return|>")


class ChatMaskError(InvalidRowError):
    """The chat template does not render conversations prefix by prefix, so turns cannot be located."""


@lru_cache(maxsize=8)
def end_of_turn_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids that end a turn: eos and whichever END_OF_TURN_TOKENS are special tokens of this tokenizer."""
    ids = {tokenizer.eos_token_id} - {None}
    for text in END_OF_TURN_TOKENS:
        tid = tokenizer.token_to_id(text)
        if tid is not None and tid in tokenizer.special_ids:
            ids.add(tid)
    return frozenset(ids)


def _render(tokenizer, messages, tools, chat_template, add_generation_prompt) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tools=tools, tokenize=False, chat_template=chat_template)
    except ChatTemplateError as e:  # the template rejected this conversation (formats checked it compiles)
        raise InvalidRowError(str(e)) from None
    return tokenizer.encode(text)  # never add_special_tokens: the template writes BOS itself


def _check_prefix(tokenizer, prefix: list[int], full: list[int], what: str) -> None:
    if full[:len(prefix)] == prefix:
        return
    at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
    raise ChatMaskError(
        f"the chat template does not render this conversation prefix by prefix: {what} is not a prefix of the "
        f"whole conversation's rendering (they differ at token {at}: "
        f"{tokenizer.decode(prefix[max(0, at - 8):at + 8])!r} vs {tokenizer.decode(full[max(0, at - 8):at + 8])!r}). "
        "surojax finds assistant turns by rendering prefixes; use a template that renders earlier turns the same "
        "whatever follows (set `chat_template:`), or drop the fields that make it differ (e.g. reasoning_content).")


def chat_ids_and_mask(messages: Sequence[Mapping], tokenizer: Tokenizer, *, tools=None,
                      chat_template: str | None = None, train_on_inputs: bool = False
                      ) -> tuple[list[int], list[bool]]:
    """(ids, mask) of a conversation: mask[t] is True where ids[t] is a token the loss is taken on."""
    full = _render(tokenizer, messages, tools, chat_template, add_generation_prompt=False)
    if train_on_inputs:
        return full, [True] * len(full)
    mask = [False] * len(full)
    eot = end_of_turn_ids(tokenizer)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        if i == 0:
            raise InvalidRowError("the conversation starts with an assistant message (nothing prompts it)")
        before = _render(tokenizer, messages[:i], tools, chat_template, add_generation_prompt=True)
        after = _render(tokenizer, messages[:i + 1], tools, chat_template, add_generation_prompt=False)
        _check_prefix(tokenizer, before, after, f"the prompt for assistant message {i} (messages[:{i}] + "
                                                f"generation prompt)")
        _check_prefix(tokenizer, after, full, f"the conversation up to assistant message {i} (messages[:{i + 1}])")
        span = range(len(before), len(after))
        stops = [t for t in span if full[t] in eot]
        for t in (range(span.start, stops[-1] + 1) if stops else span):
            mask[t] = True
    return full, mask

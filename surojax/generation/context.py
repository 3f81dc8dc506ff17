"""The context rule shared by `surojax generate` and `surojax serve`: a completion's prompt and new tokens together
fit the context (generate: the model's max_position_embeddings; serve: --max-model-len). A prompt that leaves no
room for one new token is an error naming both lengths; a max_new_tokens beyond the room left is cut to it."""
from __future__ import annotations


class ContextLengthError(ValueError):
    """The prompt fills the context: no room for a completion (a user error: the CLI prints it in one line)."""

    is_user_error = True


def completion_budget(n_prompt: int, max_new_tokens: int | None, context_len: int) -> int:
    """How many new tokens a completion of an `n_prompt`-token prompt may have in a `context_len`-token context:
    `max_new_tokens` (None: as many as fit) cut to `context_len - n_prompt`, which is at least 1.

    Raises ContextLengthError when `n_prompt >= context_len`."""
    room = context_len - n_prompt
    if room < 1:
        raise ContextLengthError(
            f"This model's maximum context length is {context_len} tokens; the prompt has {n_prompt} tokens "
            f"(the context counts prompt + completion, so the prompt must be at most {context_len - 1}).")
    return room if max_new_tokens is None else min(max_new_tokens, room)


__all__ = ["ContextLengthError", "completion_budget"]

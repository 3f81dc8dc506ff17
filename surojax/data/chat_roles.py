"""The roles a chat message may have, checked where chats come in (serve requests, chat datasets), and how
OpenAI's `developer` role reaches a chat template.

Roles: OpenAI's chat roles system, developer, user, assistant, tool. Anything else is refused naming the message,
the role and these five: a chat template given an unknown role either raises or, as Qwen's and Llama's do, drops
the message silently. (OpenAI's deprecated `function` role is not taken: its messages are `tool` messages.)

`developer` is OpenAI's newer name for the system instructions. A template that handles it names it (GPT-OSS's
harmony template renders the developer message apart from the system one): there it stays `developer`; every other
template gets the message as `system` (`for_template`, applied by `Tokenizer.apply_chat_template`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
DEVELOPER, SYSTEM = "developer", "system"


def role_problem(message: object) -> str | None:
    """Why `message` cannot be a chat message for its role (None when its role is one of CHAT_ROLES)."""
    if not isinstance(message, Mapping) or "role" not in message:
        return "has no 'role'"
    role = message["role"]
    if role not in CHAT_ROLES:
        return f"has the unknown role {role!r} (a message's role is one of {', '.join(CHAT_ROLES)})"
    return None


def for_template(messages: Sequence[Mapping], template: str) -> list[Mapping]:
    """`messages` with each `developer` message as a `system` one, unless `template` names the developer role."""
    if DEVELOPER in template or not any(m.get("role") == DEVELOPER for m in messages):
        return list(messages)
    return [{**m, "role": SYSTEM} if m.get("role") == DEVELOPER else m for m in messages]

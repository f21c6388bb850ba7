"""Chat prompts: the messages checked, the checkpoint's chat template (tokenizer_config.json's,
rendered in a jinja2 sandbox as transformers renders it) or a plain one, and a
conversation's routing key.

A checkpoint's own template is code of unknown cost: it renders with its output counted as
it comes (`ChatTemplate.render`'s limit), in a worker process that is killed past a time
limit (prompt_workers.py), so that a hostile template is a 400 naming it, never a frozen
server.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fastmamba.serve.errors import APIError

# A model folder with no chat template in tokenizer_config.json (the bundled one) gets this:
# one line a message, "role: content", then "assistant:" for the reply. A reply comes back
# as the model wrote it after "assistant:", its leading space included, and is rendered
# without a second one: a chat's next turn then starts with the tokens of the turn before,
# and resumes from their cached state.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:{% if message['content'][:1] != ' ' %} {% endif %}"
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
RENDER_SLACK_CHARS = 1 << 20  # what a template may add to its messages' text (system prompts, tool lists)


class TemplateRefused(Exception):
    """The chat template failed on these messages: its own error, or a bound it went past.
    The message names the template; the client gets it as a 400."""


class ChatTemplate:
    """The folder's chat template (tokenizer_config.json's, as transformers renders it), or
    the plain one; compiled in a sandbox, as transformers does. `builtin`: the plain one,
    whose cost is known (it may render on the event loop)."""

    def __init__(self, folder):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source, self.extra, self.builtin = PLAIN_CHAT_TEMPLATE, {}, True
        self.origin = "the plain chat template"
        cfg = Path(folder) / "tokenizer_config.json" if folder else None
        if cfg is not None and cfg.exists():
            try:
                raw = json.loads(cfg.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                raw = {}
            if isinstance(raw.get("chat_template"), str):
                source, self.builtin = raw["chat_template"], False
                self.origin = f"the chat template of {cfg}"
            self.extra = {k: raw[k] for k in ("bos_token", "eos_token") if isinstance(raw.get(k), str)}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.compiled = env.from_string(source)

    def render(self, messages: list[dict], limit: int) -> str:
        """The prompt of checked messages (`check_messages`), its output counted as it
        renders: past `limit` characters, TemplateRefused."""
        pieces, size = [], 0
        try:
            for piece in self.compiled.generate(messages=messages, add_generation_prompt=True, **self.extra):
                size += len(piece)
                if size > limit:
                    raise TemplateRefused(f"{self.origin} rendered over {limit} characters for these messages: "
                                          "refused")
                pieces.append(piece)
        except TemplateRefused:
            raise
        except MemoryError:
            raise TemplateRefused(f"{self.origin} ran out of memory rendering these messages") from None
        except Exception as e:  # a template's own error (raise_exception, a role it refuses)
            raise TemplateRefused(f"{self.origin} refused the messages: {e}") from None
        return "".join(pieces)


def render_limit(messages: list[dict]) -> int:
    """The most characters a template may render for checked messages: twice their text,
    and RENDER_SLACK_CHARS more."""
    return 2 * sum(len(m["content"]) for m in messages) + RENDER_SLACK_CHARS


def check_messages(messages) -> list[dict]:
    """The request's messages as {role, content} strings, or a 400 naming the culprit
    (messages[i], messages[i].content[j])."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's parts: the text ones, joined
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise APIError(400, f"messages[{i}].content[{j}] must be an object such as "
                                   '{"type": "text", "text": "..."}', param="messages")
                if part.get("type") == "text":
                    if not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content[{j}].text must be a string", param="messages")
                    texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        clean.append({"role": m["role"], "content": content})
    return clean


def conversation_key(messages: list[dict]) -> int:
    """A conversation's routing key (deploy.py): its messages up to its first user message,
    which every later turn repeats, so that each turn goes to the replica that holds the
    state the turn before left."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
    opening = json.dumps(messages[: first + 1], sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(opening, digest_size=8).digest(), "little")

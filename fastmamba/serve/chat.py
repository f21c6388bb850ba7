"""Chat prompts: the checkpoint's chat template (tokenizer_config.json's, rendered in a
jinja2 sandbox as transformers renders it) or a plain one, and a conversation's routing key."""

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


def chat_template(folder):
    """The folder's chat template (tokenizer_config.json's, as transformers renders it), or
    the plain one; compiled in a sandbox, as transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source, extra = PLAIN_CHAT_TEMPLATE, {}
    cfg = Path(folder) / "tokenizer_config.json" if folder else None
    if cfg is not None and cfg.exists():
        try:
            raw = json.loads(cfg.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raw = {}
        if isinstance(raw.get("chat_template"), str):
            source = raw["chat_template"]
        extra = {k: raw[k] for k in ("bos_token", "eos_token") if isinstance(raw.get(k), str)}
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source), extra


def render_chat(template, messages) -> str:
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
    compiled, extra = template
    try:
        return compiled.render(messages=clean, add_generation_prompt=True, **extra)
    except Exception as e:  # a template's own error (raise_exception, a role it refuses)
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None


def conversation_key(messages: list) -> int:
    """A conversation's routing key (deploy.py): its messages up to its first user message,
    which every later turn repeats, so that each turn goes to the replica that holds the
    state the turn before left."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
    opening = json.dumps(messages[: first + 1], sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(opening, digest_size=8).digest(), "little")

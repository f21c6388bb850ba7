"""Chat prompts: the messages checked (an assistant's tool calls and a tool's results among
them), the chat template (the checkpoint's, found and rendered as transformers finds and
renders it, with the request's tools, or a file given, or a plain one) and a conversation's
routing key.

Where the template comes from, in transformers' order: `--chat-template FILE`; else the
folder's chat_template.jinja and additional_chat_templates/NAME.jinja (what transformers'
save_pretrained writes: the default template and the named ones), which win over
tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"});
"default" unless `--chat-template-name` picks another, and "tool_use" for a request with
tools where the model has one and no flag was given (as transformers picks it); else the
plain template.

A checkpoint's own template is code of unknown cost: it renders with its output counted as
it comes (`ChatTemplate.render`'s limit), in a worker process that is killed past a time
limit (prompt_workers.py), so that a hostile template is a 400 naming it, never a frozen
server.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from fastmamba.serve.errors import APIError

# A model folder with no chat template (the bundled one) gets this:
# one line a message, "role: content", then "assistant:" for the reply. A reply comes back
# as the model wrote it after "assistant:", its leading space included, and is rendered
# without a second one: a chat's next turn then starts with the tokens of the turn before,
# and resumes from their cached state.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:{% if (message['content'] or '')[:1] != ' ' %} {% endif %}"
    "{{ message['content'] or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
RENDER_SLACK_CHARS = 1 << 20  # what a template may add to its messages' text (system prompts, tool lists)
TEMPLATE_FILE = "chat_template.jinja"  # transformers' names for the files save_pretrained writes
NAMED_TEMPLATES_FOLDER = "additional_chat_templates"
DEFAULT_NAME = "default"
TOOL_USE_NAME = "tool_use"  # the named template transformers renders a request with tools with
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # where checkpoints saved by older transformers keep them
# the named special tokens transformers hands a template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateRefused(Exception):
    """The chat template failed on these messages: its own error, or a bound it went past.
    The message names the template; the client gets it as a 400."""


class ChatTemplate:
    """The chat template of a model folder (see the module's doc for where it is found), or
    of `file` (--chat-template), `name` picking among the folder's named ones
    (--chat-template-name); compiled in a sandbox, as transformers does. A ValueError names
    what is wrong: an unreadable tokenizer_config.json, special_tokens_map.json or template
    file, an unknown name, a template that does not compile. `origin` names the template in
    messages; `builtin`: the plain one, whose cost is known (it may render on the event
    loop); `arguments`: what it was made from, for a worker process to make it again.

    A model's "tool_use" template, where it has one and no flag picked a template, renders
    the requests with tools, as transformers picks it: `tools_origin` names the template a
    request with tools renders, and `uses_tools` says whether it reads the `tools` variable
    (without it a request's tools could not reach the model)."""

    def __init__(self, folder, file: str | None = None, name: str | None = None):
        self.arguments = (folder, file, name)
        folder = Path(folder) if folder is not None else None
        config_path, config = _tokenizer_config(folder)
        self.special_tokens = _special_tokens(folder, config)
        source, self.origin, tool_use = _template_source(folder, config_path, config, file, name)
        self.builtin = source is None
        if self.builtin:
            source, self.origin = PLAIN_CHAT_TEMPLATE, "the plain chat template"
        env = _sandbox()
        self._plain = _compile(env, source, self.origin)
        self._with_tools = _compile(env, *tool_use) if tool_use else self._plain
        self.tools_origin = self._with_tools.origin
        self.uses_tools = self._with_tools.reads_tools

    def origin_for(self, tools: list | None) -> str:
        """The words naming the template that renders a request with (or without) tools."""
        return self._rendering(tools).origin

    def _rendering(self, tools: list | None) -> _Compiled:
        return self._plain if tools is None else self._with_tools

    def render(self, messages: list[dict], limit: int, tools: list | None = None) -> str:
        """The prompt of checked messages (`check_messages`) and the request's tools (the
        OpenAI dicts, as transformers passes them), its output counted as it renders: past
        `limit` characters, TemplateRefused."""
        template = self._rendering(tools)
        origin = template.origin
        if not template.takes_parts:
            messages = [_joined(m) for m in messages]
        pieces, size = [], 0
        # (tools and documents as transformers passes them: None without any, and a template
        # may test `tools is not none`)
        variables = dict(self.special_tokens, messages=messages, tools=tools, documents=None, add_generation_prompt=True)
        try:
            for piece in template.compiled.generate(**variables):
                size += len(piece)
                if size > limit:
                    raise TemplateRefused(f"{origin} rendered over {limit} characters for these messages: refused")
                pieces.append(piece)
        except TemplateRefused:
            raise
        except MemoryError:
            raise TemplateRefused(f"{origin} ran out of memory rendering these messages") from None
        except Exception as e:  # a template's own error (raise_exception, a role it refuses)
            raise TemplateRefused(f"{origin} refused the messages: {e}") from None
        return "".join(pieces)


class _Compiled(NamedTuple):
    compiled: object  # (a jinja2.Template)
    origin: str
    reads_tools: bool
    takes_parts: bool  # (see _takes_parts)


def _compile(env, source: str, origin: str) -> _Compiled:
    """A template's source compiled in `env`; one that does not compile is a ValueError
    naming it (and the line)."""
    import jinja2
    from jinja2 import meta

    try:
        compiled = env.from_string(source)
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"{origin} does not compile: {e.message}{where}") from None
    tree = env.parse(source)
    return _Compiled(compiled, origin, "tools" in meta.find_undeclared_variables(tree), _takes_parts(tree))


def _joined(message: dict) -> dict:
    """A message whose content is a list of text parts, their texts joined with a newline (as
    vLLM joins them for a template that takes a string)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _takes_parts(tree) -> bool:
    """Whether a template (its jinja2 syntax tree) reads a message's content as a list of
    OpenAI's parts, as vLLM tells it: it loops over a message's content (Gemma-3's and
    Llama-4's `{% for item in message['content'] %}`), or indexes into it
    (`messages[0]['content'][0]['text']`). Such a template gets the parts as the request
    gave them, and a string content as a string (as transformers passes both); any other
    gets each message's parts joined. Names the template sets are followed (`{% set
    loop_messages = messages[1:] %}`, `{% set content = message.content %}`)."""
    from jinja2 import nodes

    def unwrapped(node):  # (the expression under filters, tests and slices: `messages | reverse`, `messages[1:]`)
        while True:
            if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
                node = node.node
            elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
                node = node.node
            else:
                return node

    def indexed(node):  # x of x[0] and x[-1]
        if not isinstance(node, nodes.Getitem):
            return None
        index = node.arg.node if isinstance(node.arg, nodes.Neg) else node.arg
        return node.node if isinstance(index, nodes.Const) and type(index.value) is int else None

    def field(node, key: str):  # x of x['key'] and x.key
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            return node.node
        return node.node if isinstance(node, nodes.Getattr) and node.attr == key else None

    def named(node, names: set[str]) -> bool:
        node = unwrapped(node)
        return isinstance(node, nodes.Name) and node.name in names

    def closure(names: set[str], made_of) -> set[str]:  # and the names set from what `made_of` accepts
        names, grown = set(names), True
        while grown:
            grown = False
            for assign in tree.find_all(nodes.Assign):
                target = assign.target
                if isinstance(target, nodes.Name) and target.name not in names and made_of(assign.node, names):
                    names.add(target.name)
                    grown = True
        return names

    lists = closure({"messages"}, named)
    loops = {loop.target.name for loop in tree.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and named(loop.iter, lists)}

    def is_message(node, names) -> bool:
        return named(node, names) or named(indexed(node), lists)

    messages = closure(loops, is_message)

    def is_content(node, names) -> bool:
        return named(node, names) or is_message(field(unwrapped(node), "content"), messages)

    contents = closure(set(), is_content)
    return (any(is_content(loop.iter, contents) for loop in tree.find_all(nodes.For))
            or any(is_content(indexed(node), contents) for node in tree.find_all(nodes.Getitem)))


def _tokenizer_config(folder: Path | None) -> tuple[Path | None, dict]:
    """The folder's tokenizer_config.json and its contents ({} where there is none)."""
    if folder is None:
        return None, {}
    path = folder / "tokenizer_config.json"
    return path, _json_object(path)


def _json_object(path: Path) -> dict:
    """A JSON file's object ({} where there is no file); one that cannot be read or is not a
    JSON object is a ValueError naming it."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # (not UTF-8, or not JSON)
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def _special_tokens(folder: Path | None, config: dict) -> dict[str, str]:
    """The special tokens a template may use (bos_token, eos_token, ...), each a string or an
    AddedToken saved as an object with its "content": tokenizer_config.json's, and where it
    has no added_tokens_decoder (the layout of transformers before 4.34) special_tokens_map.json's
    over them, as transformers reads them (a null there unsets the token)."""
    tokens = {key: config[key] for key in SPECIAL_TOKENS if key in config}
    if folder is not None and "added_tokens_decoder" not in config:
        legacy = _json_object(folder / SPECIAL_TOKENS_MAP)
        tokens.update({key: legacy[key] for key in SPECIAL_TOKENS if key in legacy})
    for key, value in list(tokens.items()):
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
        else:
            del tokens[key]
    return tokens


def _template_source(folder, config_path, config: dict, file: str | None, name: str | None
                     ) -> tuple[str | None, str, tuple[str, str] | None]:
    """The template's text and the words that name it in messages, or (None, "") where the
    model has none (and none was asked for); and the text and words of the model's
    "tool_use" template where no flag picked one and the model has it, else None."""
    if file is not None:
        if name is not None:
            raise ValueError("--chat-template-name picks one of the model's own chat templates: it does not go with "
                             "--chat-template FILE")
        return _read(Path(file), "--chat-template"), f"the chat template {file} (--chat-template)", None
    templates = _template_files(folder) or _config_templates(config_path, config)
    if not templates:
        if name is not None:
            raise ValueError(f"--chat-template-name {name}: the model in {folder} has no chat templates")
        return None, "", None
    if (name or DEFAULT_NAME) not in templates:
        names = ", ".join(sorted(templates))
        if name is None:
            raise ValueError(f"the model in {folder} has chat templates, none named {DEFAULT_NAME!r}: pick one with "
                             f"--chat-template-name (its templates: {names})")
        raise ValueError(f"--chat-template-name {name}: the model in {folder} has no chat template of that name (its "
                         f"templates: {names})")
    source, origin = _text(*templates[name or DEFAULT_NAME])
    tool_use = _text(*templates[TOOL_USE_NAME]) if name is None and TOOL_USE_NAME in templates else None
    return source, origin, tool_use


def _text(source: str | Path, origin: str) -> tuple[str, str]:
    """A named template's text (read, where it is a file) and its words."""
    return (_read(source) if isinstance(source, Path) else source), origin


def _template_files(folder: Path | None) -> dict[str, tuple[Path, str]]:
    """{name: (file, origin)} of the folder's template files: chat_template.jinja is the
    default, additional_chat_templates/NAME.jinja the one named NAME."""
    if folder is None:
        return {}
    found = {}
    default = folder / TEMPLATE_FILE
    if default.is_file():
        found[DEFAULT_NAME] = (default, f"the chat template {default}")
    named = folder / NAMED_TEMPLATES_FOLDER
    if named.is_dir():
        for path in sorted(named.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = (path, f"the chat template {path}")
    return found


def _config_templates(config_path: Path | None, config: dict) -> dict[str, tuple[str, str]]:
    """{name: (text, origin)} of tokenizer_config.json's chat_template: a string is the
    default; a list holds {"name", "template"} objects. Anything else is a ValueError."""
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_NAME: (value, f"the chat template of {config_path}")}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: (t["template"], f"the chat template {t['name']!r} of {config_path}") for t in value}
    raise ValueError(f"{config_path}: chat_template must be a string or a list of "
                     '{"name": ..., "template": ...} objects')


def _read(path: Path, flag: str | None = None) -> str:
    """A template file's text; one that cannot be read is a ValueError naming it (and the
    flag that gave it)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        reason = e.strerror or str(e)
    except UnicodeDecodeError as e:
        reason = f"not UTF-8 text: {e.reason} at byte {e.start}"
    raise ValueError(f"{flag + ' ' if flag else ''}{path}: cannot read the chat template ({reason})")


def _sandbox():
    """A jinja2 environment as transformers compiles chat templates in: immutable sandbox,
    trim_blocks and lstrip_blocks, loop controls (break, continue), its tojson filter and
    its raise_exception and strftime_now functions, and its {% generation %} tag."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # transformers marks the assistant's part with {% generation %} ... {% endgeneration %}
        # (for training masks); what it renders is the body as it is
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    # transformers' own tojson: jinja's escapes HTML characters, and takes no indent or separators
    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


def render_limit(messages: list[dict], tools: list | None = None) -> int:
    """The most characters a template may render for checked messages and tools: twice their
    text (a message's content, its parts' JSON, and tool calls, the tools' JSON), and
    RENDER_SLACK_CHARS more."""
    size = sum(_size(m.get("content", "")) + (len(json.dumps(m["tool_calls"])) if "tool_calls" in m else 0)
               for m in messages)
    return 2 * (size + (len(json.dumps(tools)) if tools else 0)) + RENDER_SLACK_CHARS


def _size(content: str | list) -> int:
    return len(content) if isinstance(content, str) else len(json.dumps(content))


# OpenAI's roles and message fields served (`refusal` only as null; an assistant's `audio`,
# the deprecated `function_call`, anything else: a 400 naming it)
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def check_messages(messages) -> list[dict]:
    """The request's messages as {role, content} (content a string, or a list of text parts
    as given; left out of an assistant's message of tool calls without one, as transformers
    leaves out a key whose value is None: a template tests `content is defined`, or prints
    "None"), with an assistant's `tool_calls` (each function's arguments parsed from their
    JSON, as transformers' templates read them) and a tool message's `tool_call_id`; or a
    400 naming the culprit (messages[i], messages[i].content[j], ...)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        if m["role"] not in MESSAGE_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got "
                           f"{json.dumps(m['role'])[:40]}", param="messages")
        unknown = sorted(set(m) - MESSAGE_KEYS - ({"refusal"} if m.get("refusal") is None else set()))
        if unknown:
            raise APIError(400, f"messages[{i}].{unknown[0]} is not served (a message takes "
                           f"{', '.join(sorted(MESSAGE_KEYS))})", param="messages")
        if m["role"] == "tool" and m.get("tool_call_id") is None:
            raise APIError(400, f"messages[{i}].tool_call_id (a string) is needed in a tool message", param="messages")
        content = m.get("content")
        calls = _tool_calls(m, i)
        if isinstance(content, list):  # OpenAI's parts, text ones only, kept as given (see ChatTemplate.render)
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise APIError(400, f"messages[{i}].content[{j}] must be an object such as "
                                   '{"type": "text", "text": "..."}', param="messages")
                if part.get("type") != "text":  # (an image or audio part: this model reads text)
                    kind = part.get("type")
                    raise APIError(400, f"messages[{i}].content[{j}] is of type {json.dumps(kind)[:40]}: this model "
                                   "reads text parts only", param="messages", code="unsupported_content")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}].text must be a string", param="messages")
            content = list(content)
        if not isinstance(content, (str, list)) and not (content is None and calls):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        message = {"role": m["role"]}
        if content is not None:
            message["content"] = content
        if m.get("name") is not None:  # (a participant's name: the template's to render or not)
            if not isinstance(m["name"], str):
                raise APIError(400, f"messages[{i}].name must be a string", param="messages")
            message["name"] = m["name"]
        if calls:
            message["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise APIError(400, f"messages[{i}].tool_call_id must be a string", param="messages")
            message["tool_call_id"] = m["tool_call_id"]
        clean.append(message)
    return clean


def _tool_calls(message: dict, i: int) -> list[dict] | None:
    """An assistant message's tool_calls, checked, each {"id", "type": "function", "function":
    {"name", "arguments"}} with the arguments parsed from their JSON text."""
    calls = message.get("tool_calls")
    if not calls:  # (absent, null or [])
        return None
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list, in an assistant's message", param="messages")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = c.get("function") if isinstance(c, dict) else None
        if not isinstance(function, dict) or c.get("type", "function") != "function":
            raise APIError(400, f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           '"arguments": ...}}}}', param="messages")
        if not isinstance(c.get("id", ""), str) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{where}: its 'id' and its function's 'name' must be strings", param="messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise APIError(400, f"{where}.function.arguments is not JSON: {arguments[:60]!r}",
                               param="messages") from None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{where}.function.arguments must be a JSON object", param="messages")
        call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        out.append({"id": c["id"], **call} if "id" in c else call)
    return out


def conversation_key(messages: list[dict]) -> int:
    """A conversation's routing key (deploy.py): its messages up to its first user message,
    which every later turn repeats, so that each turn goes to the replica that holds the
    state the turn before left."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
    opening = json.dumps(messages[: first + 1], sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(opening, digest_size=8).digest(), "little")

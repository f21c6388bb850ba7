"""Tool calls in the chat API: the request's `tools` and `tool_choice` checked, tool_choice
as a structured-output guide, and the model's output read back as OpenAI's `tool_calls`.

- `tools` go to the chat template as transformers passes them (the OpenAI dicts as given);
  a template that makes no use of them cannot serve them (a 400).
- tool_choice "auto" (the default with tools): the model writes Hermes-style blocks,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or several, read back by
  `HermesParser`; "none": the template sees the tools, nothing is parsed.
- "required" and a named function constrain the output with a JSON schema guide
  (SamplingParams.guide, compiled by the engine with xgrammar): a named function's output
  is its arguments; "required"'s is a list of {"name", "parameters"} items, each a call.

Streaming: under "auto" the text that may begin a `<tool_call>` is held back, a block is
held until it closes and goes out as one `delta.tool_calls` entry (its whole arguments);
a named function's arguments stream token by token; "required"'s calls go out when the
reply ends (its list is read whole).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from fastmamba.serve.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that declares none takes none


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked: `tools` (for the template, as given), `choice`
    ("auto", "none", "required" or "named"), `name` (the named function), `parallel`
    (parallel_tool_calls: false keeps the first call), `guide` (SamplingParams.guide of
    "required" and "named", else None), `field` (the request field the guide is made of,
    which a guide that does not compile is a 400 naming: the named function's
    parameters, or all of `tools` for "required")."""

    tools: list
    choice: str
    name: str | None
    parallel: bool
    guide: tuple[str, str] | None
    field: str | None

    def reply(self) -> ToolReply | None:
        """A choice's reader of its output (None under "none": the text is the reply)."""
        return None if self.choice == "none" else ToolReply(self.choice, self.name, self.parallel)


def read(body: dict, template_uses_tools: bool, template_origin: str) -> ToolRequest | None:
    """The request's tools and tool_choice, or None without tools (tool_choice "none" alone
    is OpenAI's default without tools, and harmless); a 400 naming the field otherwise."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")  # (its type: fields.check_fields)
    if tools is None:
        if choice is not None and choice != "none":
            raise APIError(400, "'tool_choice' needs 'tools': there is no function to call", param="tool_choice")
        return None
    names = check_tools(tools)
    if not template_uses_tools:
        raise APIError(400, f"'tools': the model's chat template has no tool support ({template_origin} makes no "
                       "use of `tools`); give a template that does with --chat-template", param="tools",
                       code="unsupported_field")
    choice, name = check_choice(choice, names)
    parallel = parallel is not False
    functions = [t["function"] for t in tools]
    guide = field = None
    if choice == "named":
        guide = ("json_schema", json.dumps(parameters(functions[names.index(name)]), ensure_ascii=False))
        field = f"tools[{names.index(name)}].function.parameters"
    elif choice == "required":
        guide = ("json_schema", json.dumps(calls_schema(functions, parallel), ensure_ascii=False))
        field = "tools"
    return ToolRequest(tools, choice, name, parallel, guide, field)


def check_tools(tools) -> list[str]:
    """The functions' names, or a 400 naming the first bad entry's field (tools[i].type,
    tools[i].function.name, ...)."""
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects",
                       param="tools")
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            _bad(where, "must be an object {\"type\": \"function\", \"function\": {...}}")
        if tool.get("type") != "function":
            _bad(f"{where}.type", f"must be 'function' (the one kind of tool served), got {_show(tool.get('type'))}")
        function = tool.get("function")
        if not isinstance(function, dict):
            _bad(f"{where}.function", "must be an object with a 'name' (and 'description', 'parameters')")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            _bad(f"{where}.function.name", "must be a name of 1 to 64 letters, digits, '_' or '-', got "
                 f"{_show(name)}")
        if name in names:
            _bad(f"{where}.function.name", f"{name!r} names two functions")
        if not isinstance(function.get("description", ""), str):
            _bad(f"{where}.function.description", "must be a string")
        schema = function.get("parameters")
        if schema is not None and not (isinstance(schema, dict) and schema.get("type", "object") == "object"):
            _bad(f"{where}.function.parameters", "must be a JSON schema of an object (arguments are an object), got "
                 f"{_show(schema)}")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            _bad(f"{where}.function.strict", "must be true or false")
        names.append(name)
    return names


def check_choice(choice, names: list[str]) -> tuple[str, str | None]:
    """(choice, the named function or None) of tool_choice ("auto" when not given)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function" or not isinstance(function.get("name"), str):
        raise APIError(400, "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {_show(choice)}", param="tool_choice")
    if function["name"] not in names:
        raise APIError(400, f"'tool_choice' names the function {function['name']!r}, which is none of 'tools' "
                       f"({', '.join(names)})", param="tool_choice")
    return "named", function["name"]


def parameters(function: dict) -> dict:
    return function.get("parameters") or NO_PARAMETERS


def calls_schema(functions: list[dict], parallel: bool) -> dict:
    """tool_choice "required": a list of at least one call (one at most without parallel
    calls), each {"name": a function's name, "parameters": that function's arguments}."""
    items = [{"type": "object", "properties": {"name": {"enum": [f["name"]]}, "parameters": parameters(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def read_call(block: str) -> dict | None:
    """A Hermes block's call ({"name", "arguments": its JSON text}), or None where the block
    is not a JSON object with a string "name" and an object "arguments"."""
    try:
        value = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """Hermes-style tool calls in a text that comes in pieces: `push` returns the text that
    may go out now (outside any block; a tail that may begin `<tool_call>` is held) and the
    calls of the blocks that closed; `flush` returns what was held (an unclosed block is
    text). A block that is not a call's JSON stays in the text, as the model wrote it.
    `keep_one`: calls after the first are dropped (parallel_tool_calls false)."""

    def __init__(self, keep_one: bool = False):
        self.keep_one = keep_one
        self.held = ""
        self.inside = False
        self.calls = 0

    def push(self, text: str) -> tuple[str, list[dict]]:
        buf, out, calls = self.held + text, [], []
        while True:
            if not self.inside:
                at = buf.find(OPEN)
                if at < 0:
                    keep = _prefix_tail(buf, OPEN)
                    out.append(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                out.append(buf[:at])
                buf, self.inside = buf[at + len(OPEN):], True
            else:
                end = buf.find(CLOSE)
                if end < 0:
                    break
                block, buf, self.inside = buf[:end], buf[end + len(CLOSE):], False
                found = read_call(block)
                if found is None:
                    out.append(OPEN + block + CLOSE)
                elif not (self.keep_one and self.calls):
                    calls.append(found)
                    self.calls += 1
        self.held = buf
        return "".join(out), calls

    def flush(self) -> str:
        text = (OPEN if self.inside else "") + self.held
        self.held, self.inside = "", False
        return text


def parse_hermes(text: str, keep_one: bool = False) -> tuple[str | None, list[dict]]:
    """A whole reply's (content, calls): content is the text outside the blocks, None where
    calls were found and nothing but whitespace is left."""
    parser = HermesParser(keep_one)
    content, calls = parser.push(text)
    content += parser.flush()
    return (None if calls and not content.strip() else content), calls


def _prefix_tail(text: str, word: str) -> int:
    """The length of the longest tail of `text` that begins `word` (and is not all of it)."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0


class ToolReply:
    """One choice's output read as tool calls: `delta` of each streamed piece, `last` of the
    tail at its end, `message` of its whole text, `finish` of its finish reason ("tool_calls"
    for a reply that ended on its own with calls; "length" stays)."""

    def __init__(self, choice: str, name: str | None, parallel: bool):
        self.choice, self.name, self.parallel = choice, name, parallel
        self.parser = HermesParser(keep_one=not parallel) if choice == "auto" else None
        self.sent = 0  # calls streamed
        self.header: dict | None = None  # the named call, once its first delta went out

    def first_delta(self) -> dict:
        return {"role": "assistant", "content": "" if self.choice == "auto" else None}

    def delta(self, piece: str) -> dict:
        if self.choice == "auto":
            text, calls = self.parser.push(piece)
            return self._with_calls({"content": text}, calls)
        if self.choice == "named":
            if self.header is None:
                self.header = call(self.name, piece)
                return {"tool_calls": [{"index": 0, **self.header}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        return {}  # required: its list is read whole at the end

    def last(self, tail: str, text: str) -> dict:
        """The final chunk's delta: `tail` is the piece the end brings, `text` the reply's
        whole text (required's list)."""
        if self.choice == "auto":
            content, calls = self.parser.push(tail)
            return self._with_calls({"content": content + self.parser.flush()}, calls)
        if self.choice == "named":
            return self.delta(tail) if tail or self.header is None else {}
        calls = self._required_calls(text)
        if calls is None:
            return {"content": text}
        return self._with_calls({}, calls)

    def _with_calls(self, delta: dict, calls: list[dict]) -> dict:
        if calls:
            delta["tool_calls"] = [{"index": self.sent + k, **c} for k, c in enumerate(calls)]
            self.sent += len(calls)
        return delta

    def message(self, text: str) -> dict:
        """The reply's message of its whole text."""
        if self.choice == "auto":
            content, calls = parse_hermes(text, keep_one=not self.parallel)
        elif self.choice == "named":
            content, calls = None, [call(self.name, text)]
        else:
            calls = self._required_calls(text)
            content, calls = (text, []) if calls is None else (None, calls)
        self.sent = len(calls)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message

    def finish(self, reason: str) -> str:
        made = self.sent > 0 or self.header is not None
        return "tool_calls" if made and reason == "stop" else reason

    def _required_calls(self, text: str) -> list[dict] | None:
        """tool_choice "required"'s list as calls, or None where it is not one (a reply cut
        at max_tokens)."""
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                                  and isinstance(i.get("parameters"), dict) for i in items):
            return None
        items = items[:1] if not self.parallel else items
        return [call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items] or None


def _bad(field: str, why: str):
    raise APIError(400, f"'{field}' {why}", param=field)


def _show(value) -> str:
    return json.dumps(value)[:80]

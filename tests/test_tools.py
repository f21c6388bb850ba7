"""Tool calls in the chat API (serve/tools.py): tools rendered by a Hermes-style chat template
as transformers renders them, tool_choice auto (Hermes <tool_call> blocks read from the
output), named and required (the output constrained by a JSON schema guide), streamed tool
call deltas, the round trip of a call and its result, and the 400s naming the field. A
server subprocess on loopback driven with the real `openai` client (test_server.Server) over
a copy of the bundled model with this file's template."""

from __future__ import annotations

import importlib.util
import json
import re
import urllib.request

import pytest
from test_chat_templates import app_client, model_folder
from test_server import Server, openai

from fastmamba.io.folders import default_model_dir
from fastmamba.serve.chat import ChatTemplate, check_messages, render_limit
from fastmamba.serve.tools import HermesParser, ToolReply, parse_hermes

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="structured output needs xgrammar: pip install 'fastmamba[structured]'")

# a Hermes-style template: the functions listed in a system turn, an assistant's calls as
# <tool_call> blocks, a tool's result in a turn of its own
HERMES = """{% if tools %}<|system|>You may call these functions, each call one <tool_call>{"name": ..., "arguments": {...}}</tool_call>:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}{% endif %}
{% for m in messages %}
{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}

{% elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# what the named reply of the round trip is answered with
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}


def valid_arguments(name: str, arguments: str) -> bool:
    """Whether `arguments` (a call's JSON text) is what its function's schema takes."""
    value = json.loads(arguments)
    if name == "get_weather":
        return (set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome", "Oslo")
                and type(value["days"]) is int and 1 <= value["days"] <= 7)
    return name == "get_time" and value in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = model_folder(tmp_path_factory.mktemp("tools"), files={"chat_template.jinja": HERMES})
    s = Server("--model", str(folder), "--max-batch", "8", "--served-model-name", "tiny")
    s.folder = folder
    yield s
    s.stop()


def chat(server, **fields):
    return server.client().chat.completions.create(model="tiny", messages=fields.pop("messages", MESSAGES),
                                                   temperature=1.0, **fields)


# -- tool_choice auto: Hermes blocks read from a text ------------------------------------------

CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'


@pytest.mark.parametrize("text,content,calls", [
    (CALL, None, [("get_time", {"zone": "UTC"})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, "é"]}}\n</tool_call>\n' + CALL, None,
     [("f", {"a": [1, "é"]}), ("get_time", {"zone": "UTC"})]),
    ("Let me look. " + CALL + " Done.", "Let me look.  Done.", [("get_time", {"zone": "UTC"})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', '<tool_call>{"name": "f", "arguments": {"a": 1}'
     '</tool_call>', []),  # (malformed JSON: the text, no call)
    ('<tool_call>{"arguments": {}}</tool_call> ' + CALL, '<tool_call>{"arguments": {}}</tool_call> ',
     [("get_time", {"zone": "UTC"})]),  # (no name: that block stays text)
    ("No call here, <tool but no block.", "No call here, <tool but no block.", []),
    ("cut short <tool_call>{\"name\": \"f\"", "cut short <tool_call>{\"name\": \"f\"", []),
    ("", "", []),
])
def test_auto_reads_hermes_blocks(text, content, calls):
    got_content, got = parse_hermes(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in got)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("size", [1, 2, 5, 11])
def test_blocks_split_across_pieces_read_as_the_whole_text(size):
    text = "ab <tool_c" + CALL + "x<tool_call>{bad}</tool_call>" + CALL + " <tool_ca"
    parser, out, calls = HermesParser(), [], []
    for at in range(0, len(text), size):
        piece, found = parser.push(text[at:at + size])
        out.append(piece)
        calls += found
        if at + size == 10:  # ("ab <tool_c" pushed: what may begin a block is held)
            assert "".join(out) == "ab "
    out.append(parser.flush())
    content, whole = parse_hermes(text)
    assert "".join(out) == content == "ab <tool_cx<tool_call>{bad}</tool_call> <tool_ca"
    assert [c["function"] for c in calls] == [c["function"] for c in whole] == [
        {"name": "get_time", "arguments": '{"zone": "UTC"}'}] * 2


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse_hermes(CALL.replace("UTC", "CET") + CALL, keep_one=True)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "CET"}]


def test_an_auto_reply_streams_what_it_gives_whole():
    """ToolReply's deltas, piece by piece, add up to its message of the whole text."""
    text = "Sure. " + CALL + " and " + CALL.replace("UTC", "CET")
    stream = ToolReply("auto", None, parallel=True)
    deltas = [stream.delta(text[at:at + 3]) for at in range(0, len(text) - 4, 3)]
    deltas.append(stream.last(text[len(deltas) * 3:], text))
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    whole = ToolReply("auto", None, parallel=True)
    message = whole.message(text)
    assert content == message["content"] == "Sure.  and "
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    assert stream.finish("stop") == whole.finish("stop") == "tool_calls" and whole.finish("length") == "length"
    assert ToolReply("auto", None, True).finish("stop") == "stop"  # (no call)


# -- through the server ----------------------------------------------------------------------

@needs_xgrammar
def test_a_named_tool_choice_gives_a_call_of_that_function(server):
    r = chat(server, tools=TOOLS, tool_choice=NAMED, n=6, seed=0, max_tokens=60)
    assert len(r.choices) == 6
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert valid_arguments("get_weather", call.function.arguments), call.function.arguments
    assert len({c.message.tool_calls[0].function.arguments for c in r.choices}) > 1  # sampled, not one reply


@needs_xgrammar
def test_required_gives_calls_of_the_tools(server):
    r = chat(server, tools=TOOLS, tool_choice="required", n=6, seed=0, max_tokens=120)
    made = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert len(made) >= 4, [c.message for c in r.choices]
    names = set()
    for c in made:
        assert c.message.content is None and len(c.message.tool_calls) >= 1
        for call in c.message.tool_calls:
            assert valid_arguments(call.function.name, call.function.arguments), call.function
            names.add(call.function.name)
    assert names == {"get_weather", "get_time"}
    for c in r.choices:  # a list cut at max_tokens is the text, without calls
        if c.finish_reason != "tool_calls":
            assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content.startswith("[")
    # without parallel calls: exactly one, always complete
    r = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4, seed=1, max_tokens=120)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        assert valid_arguments(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)


@needs_xgrammar
def test_a_named_call_streams_its_arguments(server):
    kw = dict(tools=TOOLS, tool_choice=NAMED, seed=3, max_tokens=60)
    whole = chat(server, **kw).choices[0].message.tool_calls[0]
    headers, arguments, finish = [], "", None
    for chunk in chat(server, stream=True, **kw):
        (c,) = chunk.choices
        assert not c.delta.content
        for d in c.delta.tool_calls or ():
            assert d.index == 0
            if d.id is not None:
                headers.append((d.id, d.type, d.function.name))
            arguments += d.function.arguments or ""
        finish = c.finish_reason or finish
    assert len(headers) == 1 and headers[0][0].startswith("call_") and headers[0][1:] == ("function", "get_weather")
    assert arguments == whole.function.arguments and valid_arguments("get_weather", arguments), arguments
    assert finish == "tool_calls"


@needs_xgrammar
def test_auto_reads_the_calls_of_a_reply_streamed_or_not(server):
    """The model made to write Hermes blocks (guided_regex): auto reads them into tool calls,
    streamed (each call one delta) and whole alike; tool_choice none leaves the text."""
    regex = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
             r'</tool_call>( <tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>)?')
    kw = dict(tools=TOOLS, seed=0, max_tokens=250, extra_body={"guided_regex": regex})
    r = chat(server, n=3, **kw)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content.startswith("Sure."), c.message
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert all(valid_arguments(t.function.name, t.function.arguments) for t in c.message.tool_calls)
    content, calls, finish = "", {}, None
    for chunk in chat(server, stream=True, **kw):
        (c,) = chunk.choices
        content += c.delta.content or ""
        for d in c.delta.tool_calls or ():
            assert d.index not in calls and d.id.startswith("call_")  # (a call comes whole, in one delta)
            calls[d.index] = d.function
        finish = c.finish_reason or finish
    first = r.choices[0].message
    assert content == first.content and finish == "tool_calls"
    assert [(f.name, f.arguments) for _, f in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in first.tool_calls]
    r = chat(server, tool_choice="none", n=1, **kw)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def tokenized_prompt(server, body) -> str:
    status, got = server.post("/tokenize", body)
    assert status == 200, got
    status, text = server.post("/detokenize", {"tokens": got["tokens"]})
    return text["prompt"]


def transformers_prompt(folder, messages, tools) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


@needs_xgrammar
def test_a_round_trip_of_a_call_and_its_result(server):
    """The assistant's message of tool calls (content null) and the tool's result go back,
    render as transformers renders them (the arguments as an object), and are answered."""
    first = chat(server, tools=TOOLS, tool_choice=NAMED, seed=5, max_tokens=60).choices[0].message
    assistant = first.model_dump(exclude_none=True)
    call = assistant["tool_calls"][0]
    messages = [*MESSAGES, {**assistant, "content": None}, {**RESULT, "tool_call_id": call["id"]}]
    r = chat(server, messages=messages, tools=TOOLS, seed=5, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and r.usage.prompt_tokens > 0
    arguments = json.loads(call["function"]["arguments"])
    theirs = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {**RESULT, "tool_call_id": call["id"]}]
    expected = transformers_prompt(server.folder, theirs, TOOLS)
    assert tokenized_prompt(server, {"messages": messages, "tools": TOOLS}) == expected
    assert '"description": "The forecast"' in expected and "<|tool|>" + call["id"] + ": sunny, 21 C" in expected
    assert f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}</tool_call>' in expected
    # without tools the template gets none (None, as transformers passes it)
    assert "You may call" not in tokenized_prompt(server, {"messages": MESSAGES})


def test_tools_on_a_template_without_tool_support_are_a_400_naming_it():
    """(the app in this process over an engine never asked, with the openai client: the
    bundled model, whose template is the plain one)"""
    with app_client(default_model_dir()) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no tool support") as e:
            client.chat.completions.create(model="fastmamba-default", messages=MESSAGES, tools=TOOLS, max_tokens=2)
        assert e.value.body["param"] == "tools" and "the plain chat template" in e.value.body["message"]
        # a template without tools renders an assistant's calls and a tool's result all the same
        messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, RESULT]
        r = http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == "user: The weather in Paris?\nassistant: \ntool: sunny, 21 C\nassistant:"


def test_an_assistants_calls_without_content_render_as_in_transformers(tmp_path):
    """An assistant's message of tool calls with content null renders without content, as
    transformers renders it (it drops keys whose value is None): a template that prints the
    content prints nothing there, not "None"."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
                "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endfor %}<|assistant|>")
    folder = model_folder(tmp_path, files={"chat_template.jinja": template})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, RESULT]
    theirs = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]}, RESULT]
    expected = transformers_prompt(folder, theirs, None)
    assert expected == ('<|user|>The weather in Paris?<|assistant|><tool_call>{"name": "get_time", "arguments": '
                        '{"zone": "UTC"}}</tool_call><|tool|>sunny, 21 C<|assistant|>')
    checked = check_messages(messages)
    assert ChatTemplate(folder).render(checked, render_limit(checked)) == expected
    assert "content" not in checked[1]


def test_a_models_tool_use_template_renders_the_requests_with_tools(tmp_path):
    """A model with the named templates "default" and "tool_use" (a list in
    tokenizer_config.json, or chat_template.jinja and additional_chat_templates/tool_use.jinja)
    renders a request with tools with "tool_use" and one without with "default", as
    transformers picks them (the tools were a 400: "default" makes no use of them);
    --chat-template-name default keeps "default" for both."""
    default = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    listed = model_folder(tmp_path, {"chat_template": [{"name": "default", "template": default},
                                                       {"name": "tool_use", "template": HERMES}]}, name="listed")
    expected = transformers_prompt(listed, MESSAGES, TOOLS)
    assert expected.startswith('<|system|>You may call these functions') and '"name": "get_time"' in expected
    plain = transformers_prompt(listed, MESSAGES, None)
    assert plain == "<|user|>The weather in Paris?<|assistant|>"

    def prompt(client, body) -> str:
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    with app_client(listed) as client:
        assert prompt(client, {"messages": MESSAGES, "tools": TOOLS}) == expected
        assert prompt(client, {"messages": MESSAGES}) == plain
    files = model_folder(tmp_path, files={"chat_template.jinja": default,
                                          "additional_chat_templates/tool_use.jinja": HERMES}, name="files")
    template = ChatTemplate(files)
    assert template.uses_tools and template.tools_origin.endswith("additional_chat_templates/tool_use.jinja")
    assert template.render(MESSAGES, 1 << 20, TOOLS) == transformers_prompt(files, MESSAGES, TOOLS) == expected
    assert template.render(MESSAGES, 1 << 20) == plain
    with app_client(listed, chat_template_name="default") as client:
        r = client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
        assert r.status_code == 400 and "no tool support (the chat template 'default' of" in r.json()["error"]["message"]


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"a": {"type": "nonsense"}}}}}


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": NAMED}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is none of 'tools' (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'auto', 'none', 'required'"),
    ({"tools": []}, "tools", "non-empty list"),
    ({"tools": [TOOLS[0], {"type": "retrieval"}]}, "tools[1].type", "must be 'function'"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"description": "no name"}}]}, "tools[2].function.name",
     "must be a name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "names two functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "JSON schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x: int"}}]},
     "tools[0].function.parameters", "JSON schema of an object"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "'response_format', 'tool_choice'"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_schema",
                                                                "json_schema": {"name": "x", "schema": WEATHER}}},
     "tool_choice", "'response_format', 'tool_choice'"),
    ({"functions": [TOOLS[0]["function"]]}, "functions", "give the functions in 'tools'"),
    ({"function_call": "auto"}, "function_call", "'tools' and 'tool_choice'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     "messages[1].tool_calls[0].function.arguments is not JSON"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None}]}, "messages", "messages[1].content"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages",
     "messages[1].tool_call_id must be a string"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(server, body, param, words):
    status, got = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **body})
    assert status == 400, got
    assert got["error"]["param"] == param and words in got["error"]["message"], got
    assert param.split(".")[0].split("[")[0] in got["error"]["message"]


def stream_errors(server, body: dict) -> list[dict]:
    """The error events of a streamed chat request (its status: 200, the stream begun)."""
    req = urllib.request.Request(server.url + "/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        lines = r.read().decode().splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return [e["error"] for e in events if "error" in e]


@needs_xgrammar
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools,choice,param", [
    ([BAD_TOOL], NAMED | {"function": {"name": "f"}}, "tools[0].function.parameters"),
    ([*TOOLS, BAD_TOOL], NAMED | {"function": {"name": "f"}}, "tools[2].function.parameters"),
    ([BAD_TOOL], "required", "tools"),
    ([TOOLS[0], BAD_TOOL], "required", "tools"),
])
def test_parameters_that_do_not_compile_are_a_400_naming_the_tools(server, tools, choice, param, stream):
    body = {"messages": MESSAGES, "max_tokens": 2, "tools": tools, "tool_choice": choice}
    if stream:
        errors = stream_errors(server, body)
        assert len(errors) == 1, errors
        error = errors[0]
    else:
        status, got = server.post("/v1/chat/completions", body)
        assert status == 400, got
        error = got["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"'{param}': cannot compile the JSON schema") and "nonsense" in error["message"]


@needs_xgrammar
def test_a_bad_response_format_beside_tools_without_a_guide_is_its_own_400(server):
    """tool_choice "auto" makes no guide: the response_format's schema is the culprit."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_TOOL["function"]["parameters"]}}
    status, got = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS,
                                                       "response_format": fmt})
    assert status == 400 and got["error"]["param"] == "response_format", got
    assert got["error"]["message"].startswith("'response_format': cannot compile the JSON schema"), got


@needs_xgrammar
def test_a_named_function_compiles_beside_one_that_does_not(server):
    """Only the named function's parameters make the guide: another's bad schema is no error."""
    choice = NAMED | {"function": {"name": "get_time"}}
    status, got = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                       "tools": [BAD_TOOL, TOOLS[1]], "tool_choice": choice})
    assert status == 200 and got["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time", got

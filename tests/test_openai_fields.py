"""OpenAI's request fields as clients send them: what the server does not serve is a 400
naming the field (never a 200 that ignored it), what it serves at a neutral value passes,
`GET /v1/models/{id}`, usage that counts a prompt once, the served name, and the README's
client example run as written. A server subprocess on loopback (test_server.Server)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import Server, openai

import fastmamba

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "To be", "max_tokens": 2}

# (endpoint, field, value, words the message must carry)
REFUSED = [
    ("chat", "tools", [TOOL], "no tool support"),  # (the bundled model's plain template; tools: test_tools.py)
    ("chat", "tool_choice", "auto", "needs 'tools'"),
    ("chat", "functions", [TOOL["function"]], "give the functions in 'tools'"),
    ("chat", "function_call", "auto", "give 'tools' and 'tool_choice'"),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}, "text only"),
    ("chat", "modalities", ["text", "audio"], "['audio']"),
    ("chat", "prediction", {"type": "content", "content": "x"}, "predicted outputs"),
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "'schema'"),
    ("chat", "response_format", {"type": "xml"}, "'text', 'json_object' or 'json_schema'"),
    ("chat", "reasoning_effort", "high", "no such setting"),
    ("chat", "verbosity", "low", "no such setting"),
    ("chat", "store", True, "stores no completions"),
    ("chat", "service_tier", "flex", "one tier"),
    ("chat", "web_search_options", {}, "web search"),
    ("chat", "echo", True, "a field of /v1/completions"),
    ("chat", "top_logprobs", 2, "needs 'logprobs': true"),
    ("chat", "frobnicate", 1, "unrecognized request field 'frobnicate'"),
    ("completions", "suffix", "end", "fill in the middle"),
    ("completions", "best_of", 3, "best_of may only equal n"),
    ("completions", "tools", [TOOL], "a field of /v1/chat/completions"),
    ("completions", "messages", [], "a field of /v1/chat/completions"),
    ("completions", "frobnicate", 1, "unrecognized request field 'frobnicate'"),
]

SERVED_AT_NEUTRAL = [
    ("chat", {"response_format": {"type": "text"}, "modalities": ["text"], "store": False, "user": "u",
              "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": False}),
    ("chat", {"logprobs": True, "top_logprobs": 2}),
    ("completions", {"best_of": 2, "n": 2, "suffix": "", "user": "u", "prompt_cache_key": "k"}),
]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch", "4", "--served-model-name", "tiny")
    yield s
    s.stop()


def path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


@pytest.mark.parametrize("endpoint,field,value,words", REFUSED, ids=[f"{e}-{f}-{i}" for i, (e, f, _, _) in enumerate(REFUSED)])
def test_a_field_not_served_is_a_400_naming_it(server, endpoint, field, value, words):
    status, body = server.post(path(endpoint), {**(CHAT if endpoint == "chat" else COMPLETION), field: value})
    assert status == 400, body
    assert body["error"]["param"] == field
    assert words in body["error"]["message"], body
    assert f"'{field}'" in body["error"]["message"] or field in body["error"]["message"]


@pytest.mark.parametrize("endpoint,extra", SERVED_AT_NEUTRAL)
def test_fields_at_their_neutral_value_are_served(server, endpoint, extra):
    status, body = server.post(path(endpoint), {**(CHAT if endpoint == "chat" else COMPLETION), **extra})
    assert status == 200, body
    assert len(body["choices"]) == extra.get("n", 1)


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_image_and_audio_content_parts_are_refused_naming_them(server, part):
    """(they were dropped: an image-only message answered as an empty one)"""
    message = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}
    status, body = server.post("/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert "messages[0].content[1]" in body["error"]["message"] and part["type"] in body["error"]["message"]


@pytest.mark.parametrize("message,words", [
    ({"role": "wizard", "content": "x"}, "messages[0].role must be one of"),
    ({"role": "user", "content": "x", "bogus": 1}, "messages[0].bogus is not served"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f"}}, "messages[0].function_call is not served"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id (a string) is needed"),
    ({"role": "user", "content": "x", "name": 3}, "messages[0].name must be a string"),
])
def test_a_message_of_an_unknown_role_or_field_is_a_400_naming_it(server, message, words):
    status, body = server.post("/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages" and words in body["error"]["message"], body


def test_a_message_with_a_name_and_a_null_refusal_is_served(server):
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "ho", "refusal": None},
                {"role": "user", "content": "again"}]
    status, body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body


def test_the_openai_client_hears_why_tools_are_refused(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError, match="no tool support"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    with pytest.raises(openai.BadRequestError, match="'json_object' or 'json_schema'"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                  response_format={"type": "xml"})


def test_models_retrieve(server):
    c = server.client()
    model = c.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="tiny"):
        c.models.retrieve("gpt-4")


def test_usage_counts_a_prompt_once_whatever_n(server):
    _, tokens = server.post("/tokenize", {"prompt": "To be, or not to be"})
    c = server.client()
    out = c.completions.create(model="tiny", prompt="To be, or not to be", max_tokens=3, n=2, seed=1)
    assert out.usage.prompt_tokens == tokens["count"]
    assert out.usage.completion_tokens == 6
    # two prompts of n=2: each prompt once
    out = c.completions.create(model="tiny", prompt=["To be, or not to be", "To be, or not to be"], max_tokens=3, n=2)
    assert out.usage.prompt_tokens == 2 * tokens["count"] and out.usage.completion_tokens == 12


def test_the_served_name_is_the_model_folders_name(tmp_path):
    import shutil

    folder = tmp_path / "my-mamba"
    shutil.copytree(fastmamba.default_model_dir(), folder)
    s = Server("--model", str(folder) + "/", "--max-batch", "2")
    try:
        assert [m.id for m in s.client().models.list().data] == ["my-mamba"]
        assert s.client().completions.create(model="my-mamba", prompt="To be", max_tokens=2).choices
    finally:
        s.stop()


def test_the_readmes_client_example_runs_as_written():
    """README's Python block against `fastmamba serve` as its first command starts it (the
    bundled model); only the port differs, as the test takes a free one."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from openai import OpenAI" in b)
    assert "http://127.0.0.1:8000/v1" in block
    s = Server("--max-batch", "2")
    try:
        code = block.replace("http://127.0.0.1:8000/v1", s.url + "/v1")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        want = fastmamba.load().generate("To be", max_tokens=20, temperature=1.0, seed=1).text  # (the API's default)
        assert r.stdout == want + "\n"  # (print adds one newline)
    finally:
        s.stop()

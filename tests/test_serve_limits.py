"""`fastmamba serve` against clients' mistakes: every one is a 4xx naming it, never a 500 or a
429 no retry could pass. A real server subprocess on a loopback port; every loop is bounded
in count and time."""

from __future__ import annotations

import json

import pytest
from test_server import Server

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch", "4", "--max-queue", "8")
    yield s
    s.stop()


def error(status_and_body, status: int) -> dict:
    got, body = status_and_body
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_json_too_deep_or_with_a_huge_number_is_a_400_naming_it(server):
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert "nested over 64" in error(server.post("/v1/completions", deep), 400)["message"]
    huge = b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}"
    assert "more than 100 digits" in error(server.post("/v1/completions", huge), 400)["message"]
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "n": ' + b"1" * 5000 + b"}"
    assert "more than 100 digits" in error(server.post("/v1/chat/completions", chat), 400)["message"]


def test_body_shape_check_reads_structure_not_strings():
    from fastmamba.serve.errors import APIError
    from fastmamba.serve.requests import MAX_DEPTH, check_shape

    check_shape(json.dumps({"p": "[" * 500 + "9" * 500, "q": 'a \\" [[[ "'}).encode())  # inside strings: text
    check_shape(json.dumps({"p": [[1, [2]], {"a": [3]}] * 100, "n": 10**99}).encode())
    nested = [1]
    for _ in range(MAX_DEPTH - 2):
        nested = [nested]
    check_shape(json.dumps({"p": nested}).encode())  # exactly MAX_DEPTH levels
    with pytest.raises(APIError, match=f"nested over {MAX_DEPTH}"):
        check_shape(json.dumps({"p": [nested]}).encode())
    with pytest.raises(APIError, match="more than 100 digits"):
        check_shape(b'{"n": 1e' + b"0" * 101 + b"}")


def test_chat_content_parts_that_are_not_text_strings_are_400s_naming_them(server):
    for text in (7, None, ["a"]):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": text}]}]
        err = error(server.post("/v1/chat/completions", {"messages": msgs}), 400)
        assert "messages[0].content[1].text" in err["message"] and err["param"] == "messages"
    msgs = [{"role": "system", "content": "hi"}, {"role": "user", "content": ["not a part"]}]
    assert "messages[1].content[0]" in error(server.post("/v1/chat/completions", {"messages": msgs}), 400)["message"]
    assert "messages[1].content[0]" in error(server.post("/tokenize", {"messages": msgs}), 400)["message"]


def test_a_request_that_can_never_fit_is_a_400_and_one_that_fits_runs(server):
    """4 slots + 8 queued: 4 prompts x n=4 can never be taken (a 400 saying why, which no
    retry passes); 4 x n=3 fills it exactly and runs."""
    prompts = [f"Act {k}." for k in range(4)]
    err = error(server.post("/v1/completions", {"prompt": prompts, "n": 4, "max_tokens": 1}), 400)
    assert err["param"] == "n" and "16" in err["message"] and "12" in err["message"]
    status, out = server.post("/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 1})
    assert status == 200 and len(out["choices"]) == 12

"""Which fields of OpenAI's request bodies the server takes, and a 400 naming any other.

A client that asks for something the server does not do (audio, a suffix) must hear
so, not get a 200 that quietly ignored it. Every field of OpenAI's
completions and chat bodies is listed here: the ones served, the ones served only at their
neutral value (`store: false`, `modalities: ["text"]`),
the ones that only identify or describe the caller and change no token (`user`,
`metadata`), and the ones refused, each with the reason the client reads. A field OpenAI
does not define is refused as OpenAI refuses it ("unrecognized").
"""

from __future__ import annotations

import json

from fastmamba.serve.errors import APIError

# served by both endpoints (vLLM's extensions included: top_k, min_p, repetition_penalty,
# stop_token_ids, and structured output's guided_regex and guided_choice, read in requests.guide
# with chat's response_format; chat's tools and tool_choice are read in tools.py)
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "n", "stream", "stream_options", "logprobs", "logit_bias", "presence_penalty",
    "frequency_penalty", "guided_regex", "guided_choice",
    # the caller's identity or bookkeeping: no token depends on them
    "user", "metadata", "safety_identifier", "prompt_cache_key",
}
SERVED = {
    "completions": _COMMON | {"prompt", "echo", "best_of", "suffix"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "modalities",
                       "store", "service_tier", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
                       "verbosity"},
    # a completion's prompt, or a chat's messages and what else its prompt is made of
    "tokenize": {"model", "prompt", "messages", "tools", "tool_choice", "parallel_tool_calls"},
    "detokenize": {"model", "tokens"},
}

_NOT_SERVED = "is not supported by this server"
# OpenAI's fields this server does not implement, and what the client is told
REFUSED = {
    "functions": f"'functions' (OpenAI's deprecated form of tools) {_NOT_SERVED}: give the functions in 'tools'",
    "function_call": f"'function_call' (OpenAI's deprecated form of tool_choice) {_NOT_SERVED}: give 'tools' and "
                     "'tool_choice'",
    "audio": f"'audio' {_NOT_SERVED}: the model reads and writes text only",
    "prediction": f"'prediction' (predicted outputs) {_NOT_SERVED}",
    "web_search_options": f"'web_search_options' {_NOT_SERVED}: it has no web search",
}


def check_fields(body: dict, endpoint: str) -> None:
    """A 400 naming the first field of `body` that the endpoint ("completions", "chat",
    "tokenize" or "detokenize") does not serve, or serves only at a value other than the one given."""
    served = SERVED[endpoint]
    for name, value in body.items():
        if name in REFUSED:
            raise APIError(400, REFUSED[name], param=name, code="unsupported_field")
        if name not in served:
            raise APIError(400, f"unrecognized request field '{name}'{_hint(name, endpoint)}", param=name,
                           code="unrecognized_field")
        if value is not None:
            _check_value(name, value, body, endpoint)


def _hint(name: str, endpoint: str) -> str:
    """Where an unrecognized field belongs, where that helps the client."""
    if endpoint in ("tokenize", "detokenize"):
        return f"; /{endpoint} takes {', '.join(sorted(SERVED[endpoint]))}"
    other = "completions" if endpoint == "chat" else "chat"
    return f"; it is a field of /v1/{'chat/' if other == 'chat' else ''}completions" if name in SERVED[other] else ""


def _refuse(name: str, why: str):
    raise APIError(400, f"'{name}' {why}", param=name, code="unsupported_field")


def _check_stream_options(value, body: dict) -> None:
    """OpenAI's checks: an object, given only with `stream: true` (an empty one aside, as
    vLLM lets it be), holding only `include_usage`, true or false: a misspelt key or a
    string "no" would otherwise pass for what the client did not mean."""
    name = "stream_options"
    if not isinstance(value, dict):
        raise APIError(400, f"'{name}' must be an object, got {json.dumps(value)[:60]}", param=name)
    if value and body.get("stream") is not True:
        raise APIError(400, f"'{name}' can only be given when 'stream' is true", param=name)
    for key, option in value.items():
        if key != "include_usage":
            raise APIError(400, f"unrecognized field '{name}.{key}': it takes 'include_usage'", param=name,
                           code="unrecognized_field")
        if option is not True and option is not False:
            raise APIError(400, f"'{name}.include_usage' must be true or false, got {json.dumps(option)[:40]}",
                           param=name)


def _check_value(name: str, value, body: dict, endpoint: str) -> None:
    """Fields served only at their neutral value (the others are checked where they are read)."""
    if name == "response_format":  # (json_object's and json_schema's specs: requests.guide)
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(400, "'response_format' must be an object whose 'type' is 'text', 'json_object' or "
                           f"'json_schema', got {json.dumps(value)[:80]}", param=name)
    elif name == "modalities":
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise APIError(400, "'modalities' must be a list of strings", param=name)
        if set(value) - {"text"}:
            _refuse(name, f"{sorted(set(value) - {'text'})} {_NOT_SERVED}: the model writes text only")
    elif name == "store" and value is not False:
        _refuse(name, f"true {_NOT_SERVED}: it stores no completions")
    elif name == "service_tier" and value not in ("auto", "default"):
        _refuse(name, f"{json.dumps(value)[:40]} {_NOT_SERVED}: it has one tier ('auto' or 'default')")
    elif name == "parallel_tool_calls" and value is not False and value is not True:
        raise APIError(400, "'parallel_tool_calls' must be true or false", param=name)
    elif name in ("reasoning_effort", "verbosity"):
        _refuse(name, f"{_NOT_SERVED}: the model has no such setting")
    elif name == "suffix" and value != "":
        _refuse(name, f"{_NOT_SERVED}: it does not fill in the middle")
    elif name == "best_of":
        if value != (body.get("n") or 1):
            _refuse(name, f"{json.dumps(value)[:20]} {_NOT_SERVED}: it does not rank extra candidates "
                    "(best_of may only equal n)")
    elif name == "stream_options":
        _check_stream_options(value, body)
    elif name == "top_logprobs" and endpoint == "chat" and body.get("logprobs") is not True:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param=name)

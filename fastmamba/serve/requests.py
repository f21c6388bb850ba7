"""Reading an OpenAI request's body: the JSON (its size, depth and numbers bounded before it
is parsed), each field type- and range-checked (a 400 naming the field, never a 500 for a
client's mistake), the prompts, the sampling parameters."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import re

import msgspec

from fastmamba.core.sampling_params import SamplingParams
from fastmamba.io.prompts import check_token_ids
from fastmamba.serve.errors import APIError, too_large
from fastmamba.serve.prompt_workers import PromptWorkers

MAX_PROMPTS = 64  # prompts in one completions request
MAX_DEPTH = 64  # nesting of a request body's arrays and objects (OpenAI's bodies need 4)
MAX_DIGITS = 100  # digits of one number in a request body (a seed or a token id needs 10)

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (its escapes skipped whole)
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(c for c in range(256) if c not in _BRACKETS)
_DIGIT_RUNS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))  # digits to "0", the rest to " "
log = logging.getLogger("uvicorn.error")


class ClientGone(APIError):
    """The client hung up while it sent its body: nobody to answer (one log line, no traceback)."""

    def __init__(self):
        super().__init__(499, "the client hung up while sending its request body")


async def read_json(request, limit: int, timeout: float) -> dict:
    """The request's body as a JSON object: its bytes counted as they come (a body sent
    without a Content-Length too), each piece awaited at most `timeout` seconds (a 408
    after), its shape bounded (check_shape) before it is parsed."""
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    pieces = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stalled: nothing came for {timeout:g} s (--client-timeout)",
                           code="request_timeout") from None
        except ClientDisconnect:
            client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
            log.warning("%s hung up while sending its request body", client)
            raise ClientGone() from None
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    check_shape(raw)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def check_shape(raw: bytes) -> None:
    """A 400 for a body nested deeper than MAX_DEPTH or holding a number of more than
    MAX_DIGITS digits, found before any parser recurses into it or converts the number
    (C-speed passes over the bytes: strings' contents blanked, then the digit runs and the
    brackets read)."""
    bare = _STRING.sub(b'""', raw)
    if b"0" * (MAX_DIGITS + 1) in bare.translate(_DIGIT_RUNS):
        raise APIError(400, f"the request body holds a number of more than {MAX_DIGITS} digits")
    brackets = bare.translate(None, _NOT_BRACKETS)
    if len(brackets) > MAX_DEPTH:
        import numpy as np

        steps = np.frombuffer(brackets, dtype=np.uint8)
        depth = np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1), dtype=np.int64)
        if depth.max() > MAX_DEPTH:
            raise APIError(400, f"the request body is nested over {MAX_DEPTH} levels deep")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "an object"}


def get(body: dict, name: str, kind, default=None, lo=None, hi=None, required=False):
    """body[name], type- and range-checked; a missing or null field is `default`."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"'{name}' is required", param=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = any(isinstance(value, k) and not (k in (int, float) and isinstance(value, bool)) for k in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise APIError(400, f"'{name}' must be {names}, got {json.dumps(value)[:60]}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"from {lo} to {hi}" if lo is not None and hi is not None else f"at least {lo}" if hi is None else f"at most {hi}"
        raise APIError(400, f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def check_model(body: dict, served: str) -> None:
    model = get(body, "model", str, served)
    if model != served:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served}'", param="model",
                       code="model_not_found")


def sampling_fields(body: dict, vocab: int, tool_guide: tuple[str, str] | None = None) -> dict:
    """The request's sampling fields, type-checked; each choice's SamplingParams is made from
    them once (`sampling_params`), with its own seed and max_tokens. `tool_guide`: the guide
    of a tool_choice (tools.py)."""
    top_k = get(body, "top_k", int, 0)
    seed = get(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**32:
        raise APIError(400, f"'seed' must be from 0 to 2^32 - 1, got {seed}", param="seed")
    stop_ids = get(body, "stop_token_ids", list, None)
    if stop_ids:  # (an empty list: no stop tokens)
        check_ids(stop_ids, vocab, "stop_token_ids")
    for name in ("max_tokens", "max_completion_tokens"):
        get(body, name, int, None, lo=1)
    return dict(
        temperature=get(body, "temperature", float, 1.0),
        top_k=0 if top_k == -1 else top_k, top_p=get(body, "top_p", float, 1.0), min_p=get(body, "min_p", float, 0.0),
        repetition_penalty=get(body, "repetition_penalty", float, 1.0), seed=seed, stop_token_ids=stop_ids,
        logit_bias=logit_bias(body, vocab), presence_penalty=get(body, "presence_penalty", float, 0.0),
        frequency_penalty=get(body, "frequency_penalty", float, 0.0), guide=guide(body, tool_guide),
    )


def guide(body: dict, tool_guide: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """The request's structured output, as SamplingParams.guide: chat's response_format
    (json_object, or json_schema with {name, schema, strict}), vLLM's guided_regex or
    guided_choice, or `tool_guide` (tool_choice "required" or a named function); one of
    them at most. Checked here as far as no grammar is compiled (the engine compiles it, and
    a spec it cannot compile is a 400 naming the field too)."""
    found = []
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        found.append(("response_format", ("json_object", "")))
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': "
                           "a JSON schema (an object), 'strict': ...}", param="response_format")
        if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise APIError(400, "'response_format': json_schema's 'name' must be a string and 'strict' true or false",
                           param="response_format")
        found.append(("response_format", ("json_schema", json.dumps(schema, ensure_ascii=False))))
    regex = get(body, "guided_regex", str, None)
    if regex is not None:
        try:
            re.compile(regex)
        except (re.error, RecursionError, OverflowError) as e:
            raise APIError(400, f"'guided_regex' is not a regular expression: {e}", param="guided_regex") from None
        if not regex:
            raise APIError(400, "'guided_regex' is empty", param="guided_regex")
        found.append(("guided_regex", ("regex", regex)))
    choices = get(body, "guided_choice", list, None)
    if choices is not None:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise APIError(400, "'guided_choice' must be a non-empty list of non-empty strings", param="guided_choice")
        found.append(("guided_choice", ("choice", json.dumps(choices, ensure_ascii=False))))
    if tool_guide is not None:
        found.append(("tool_choice", tool_guide))
    if len(found) > 1:
        raise APIError(400, f"give one structured output at most: {', '.join(repr(n) for n, _ in found)} were given",
                       param=found[1][0])
    if not found:
        return None
    if importlib.util.find_spec("xgrammar") is None:
        raise APIError(400, f"'{found[0][0]}' needs structured output, which needs xgrammar: "
                       "pip install 'fastmamba[structured]'", param=found[0][0])
    return found[0][1]


_TOKEN_KEY = re.compile(r"[0-9]{1,20}")


def logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object of token ids (as strings, JSON's keys) to numbers, the
    ids checked against the vocabulary; the values' range and the entries' count are
    SamplingParams' checks (`sampling_params`)."""
    bias = get(body, "logit_bias", dict, None)
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise APIError(400, f"'logit_bias' keys must be token ids (strings of digits), got {json.dumps(key)[:60]}",
                           param="logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise APIError(400, f"'logit_bias' values must be numbers, got {json.dumps(value)[:60]} for token {key}",
                           param="logit_bias")
        out[int(key)] = value
    check_ids(list(out), vocab, "logit_bias")
    return out


def sampling_params(fields: dict, **choice) -> SamplingParams:
    """SamplingParams of the fields (with a choice's own seed and max_tokens): checked here,
    once, and never again on the engine's side."""
    try:
        return SamplingParams(**{**fields, **choice})
    except ValueError as e:  # "SamplingParams.<field> ...": name the request's field
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise APIError(400, str(e).replace("SamplingParams.", "", 1), param=field) from None


def check_ids(ids: list, vocab: int, name: str) -> None:
    """The library's check of token ids (the first culprit named), as a 400 naming the field."""
    if not ids:
        raise APIError(400, f"'{name}' is empty", param=name)
    try:
        check_token_ids(ids, vocab, f"'{name}'")
    except ValueError as e:
        raise APIError(400, str(e), param=name) from None


async def encode(workers: PromptWorkers, text: str, name: str) -> list[int]:
    """A text's ids (a long one's tokenized off the event loop), a 400 naming the field."""
    try:
        return await workers.encode(text)
    except ValueError as e:
        raise APIError(400, f"'{name}': {e}", param=name) from None


async def prompts(workers: PromptWorkers, prompt) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt: a string, a list of token ids, or a list of either."""
    encoder = workers.encoder
    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [(prompt, await encode(workers, prompt, "prompt"))]
    if _is_ids(prompt):
        check_ids(prompt, encoder.vocab_size, "prompt")
        return [(await workers.decode(prompt) if encoder.tokenizer else "", list(prompt))]
    # a batch: strings and lists of ids, one level deep, as OpenAI takes them
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return [p for each in await asyncio.gather(*(prompts(workers, item) for item in prompt)) for p in each]
    raise APIError(400, f"'prompt' must be a string, a list of token ids, or a non-empty list of at most {MAX_PROMPTS} "
                   "of those (strings or lists of token ids)", param="prompt")


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

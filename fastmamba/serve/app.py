"""`fastmamba serve`: an OpenAI-compatible HTTP API, the front end of the engine process
(engine_process.py, engine.py).

This process parses, validates, tokenizes, detokenizes (stop strings included) and streams;
the engine, in a process of its own, owns the model. Endpoints: POST /v1/completions, /v1/chat/completions (both with `stream`), GET
/v1/models, /health, /metrics, POST /tokenize, /detokenize. Errors are OpenAI's bodies
({"error": {"message", "type", "param", "code"}}): 400 for a bad field (naming it),
malformed JSON or an over-long prompt, 401 without the API key, 404 for an unknown model,
429 when the queue is full; never a 500 for a client's mistake.
"""

import asyncio
import dataclasses
import hashlib
import json
import threading
import time
import uuid
from pathlib import Path

from fastmamba.engine.process import EngineClient, EngineDown, QueueFull
from fastmamba.io.prompts import PromptEncoder, check_token_ids
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.io.tokenizer import IncrementalDecoder

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
MAX_N = 16
MAX_LOGPROBS = 20
DISCONNECT_CHECK_S = 0.25  # how often a non-streaming request looks for a client that hung up


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def metrics_registry():
    """The engine's metrics, named as vLLM's with a `fastmamba:` prefix, in a registry of
    their own."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    latency = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
    m = {}
    for name, doc in [("time_to_first_token_seconds", "time from arrival to the first token"),
                      ("inter_token_latency_seconds", "time between a request's tokens"),
                      ("e2e_request_latency_seconds", "time from arrival to the last token"),
                      ("request_queue_time_seconds", "time from arrival to a state slot")]:
        m[name] = Histogram(f"fastmamba:{name}", doc, buckets=latency, registry=reg)
    for name, doc in [("num_requests_running", "requests holding a state slot"),
                      ("num_requests_waiting", "requests queued for a slot"),
                      ("state_slots_used", "state slots in use")]:
        m[name] = Gauge(f"fastmamba:{name}", doc, registry=reg)
    for name, doc in [("prompt_tokens_total", "prompt tokens admitted"),
                      ("generation_tokens_total", "tokens generated"),
                      ("prefix_cache_queries_total", "prefix cache lookups"),
                      ("prefix_cache_hits_total", "prefix cache hits"),
                      ("request_success_total", "requests finished")]:
        m[name] = Counter(f"fastmamba:{name[: -len('_total')]}", doc, registry=reg)
    return reg, m


def create_app(engine: EngineClient, encoder: PromptEncoder, model_name: str, api_key: str | None = None,
               max_model_len: int = 32768, registry=None, metrics=None, max_body_bytes: int = 8 << 20):
    """The FastAPI app over a running engine process; `encoder` encodes prompts with the
    checkpoint's tokenizer (its path: the chat template's folder)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="fastmamba", docs_url=None, redoc_url=None)
    template = _chat_template(encoder.path)
    if metrics is not None:
        engine.on_stats = _stats_to_metrics(metrics)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", kind="server_error").body(), status_code=500)

    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(_engine_down().body(), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "fastmamba"}]}

    @app.get("/metrics")
    async def metrics_page():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        body = await _json(request, max_body_bytes)
        if "messages" in body:
            ids = _encode(encoder, _render_chat(template, body["messages"]), "messages")
        else:
            ids = _encode(encoder, _get(body, "prompt", str, required=True), "prompt")
        return {"tokens": ids, "count": len(ids)}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        body = await _json(request, max_body_bytes)
        ids = _get(body, "tokens", list, required=True)
        _check_ids(ids, encoder.vocab_size, "tokens")
        return {"prompt": encoder.tokenizer.decode(ids) if encoder.tokenizer else None}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await _json(request, max_body_bytes)
        _check_model(body, model_name)
        prompts = _prompts(encoder, body.get("prompt"))
        logprobs = _get(body, "logprobs", int, None, lo=0, hi=MAX_LOGPROBS)
        echo = _get(body, "echo", bool, False)
        max_tokens = _get(body, "max_tokens", int, 16)  # OpenAI's default for completions
        return await _serve(request, body, prompts, chat=False, top_logprobs=logprobs, echo=echo, max_tokens=max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await _json(request, max_body_bytes)
        _check_model(body, model_name)
        text = _render_chat(template, body.get("messages"))
        prompts = [(text, _encode(encoder, text, "messages"))]
        top = _get(body, "top_logprobs", int, 0, lo=0, hi=MAX_LOGPROBS)
        top_logprobs = top if _get(body, "logprobs", bool, False) else None
        # max_completion_tokens is OpenAI's current name, max_tokens the older one; without
        # either, a reply runs until a stop or --max-model-len
        max_tokens = _get(body, "max_tokens", int, None)
        newer = _get(body, "max_completion_tokens", int, None)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise APIError(400, f"'max_completion_tokens' ({newer}) and 'max_tokens' ({max_tokens}) disagree: "
                           "give one of them", param="max_completion_tokens")
        max_tokens = newer if newer is not None else max_tokens
        return await _serve(request, body, prompts, chat=True, top_logprobs=top_logprobs, echo=False, max_tokens=max_tokens,
                            route=_conversation_key(body["messages"]))

    async def _serve(request, body, prompts, chat: bool, top_logprobs, echo: bool, max_tokens: int | None,
                     route: int | None = None):
        n = _get(body, "n", int, 1, lo=1, hi=MAX_N)
        stream = _get(body, "stream", bool, False)
        opts = _get(body, "stream_options", dict, {}) or {}
        include_usage = bool(opts.get("include_usage", False))
        stop = _get(body, "stop", (str, list), None)
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "stop must be a string or a list of non-empty strings", param="stop")
        _get(body, "user", str, None)
        params = _sampling(body, encoder.vocab_size)
        for _, ids in prompts:
            if len(ids) >= max_model_len:
                raise APIError(400, f"the prompt has {len(ids)} tokens, and this server's limit for prompt + max_tokens "
                               f"is {max_model_len} (--max-model-len)", param="prompt", code="context_length_exceeded")
            if max_tokens is not None and len(ids) + max_tokens > max_model_len:
                raise APIError(400, f"max_tokens {max_tokens} + the prompt's {len(ids)} tokens is over this server's "
                               f"limit of {max_model_len} (--max-model-len)", param="max_tokens",
                               code="context_length_exceeded")
        if not engine.alive:
            raise _engine_down()
        events: asyncio.Queue = asyncio.Queue()
        choices = []
        for p, (_, ids) in enumerate(prompts):
            for k in range(n):
                seed = None if params.seed is None else (params.seed + k) % 2**32
                limit = max_tokens if max_tokens is not None else max_model_len - len(ids)
                choices.append(_Choice(len(choices), ids, dataclasses.replace(params, seed=seed, max_tokens=limit),
                                       stop, top_logprobs, encoder.tokenizer, events, engine, metrics, route))
        try:
            for c in choices:
                c.submit()
        except (QueueFull, EngineDown) as e:
            for c in choices:
                c.cancel()
            if isinstance(e, EngineDown):
                raise _engine_down() from None
            raise APIError(429, f"the server is busy: {e}; try again later", code="rate_limit_exceeded",
                           kind="rate_limit_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _Shape(rid, model_name, chat, encoder, [prompts[i // n][0] if echo else "" for i in range(len(choices))])
        if stream:
            return StreamingResponse(_stream(request, choices, events, shape, include_usage),
                                     media_type="text/event-stream")
        return await _collect(request, choices, events, shape)

    async def _collect(request, choices, events, shape):
        done = 0
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_CHECK_S
        try:
            while done < len(choices):
                # a client that hung up is looked for on a clock, not only when the engine is
                # quiet: a request that keeps producing tokens would otherwise run to its end
                if loop.time() >= check_at:
                    check_at = loop.time() + DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
                try:
                    index, kind, data = await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    continue
                if kind == "error":
                    raise _generation_failed(data)
                shape.add(index, kind, data)
                done += kind == "done"
        finally:
            for r in choices:
                r.cancel()
        return shape.response()

    async def _stream(request, choices, events, shape, include_usage):
        done = 0
        try:
            if shape.chat:
                for i in range(len(choices)):
                    yield _sse(shape.chunk(i, {"role": "assistant", "content": ""}, None, None))
            failed = False
            while done < len(choices) and not failed:
                # every event waiting goes out in one write: a loop that falls behind the
                # engine catches up in fewer, larger writes
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                out = []
                for index, kind, data in batch:
                    if kind == "error":
                        out.append(_sse(_generation_failed(data).body()))
                        failed = True
                        break
                    piece, finish, logprob = shape.add(index, kind, data)
                    # a chunk for every token, its text empty where the token ends no character
                    # (or the model has no tokenizer): clients count and time tokens by chunks
                    if kind == "token" or piece or finish:
                        out.append(shape.sse_chunk(index, piece, finish, logprob))
                    done += kind == "done"
                yield "".join(out)
            if include_usage:
                yield _sse(shape.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:  # a client that went away cancels its requests and frees their slots
            for r in choices:
                r.cancel()

    return app


class _Gate:
    """What a request must pass before FastAPI reads it: the API key (not on /health), and a
    Content-Length within the body limit (413 before a byte of the body is read; _json also
    counts the bytes of a body sent without one). Plain ASGI: Starlette's @app.middleware
    hides a client's disconnect from the endpoint, and a request whose client hung up must
    be cancelled."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            error = None
            if self.key is not None and scope["path"] != "/health" and headers.get(b"authorization") != self.key:
                error = APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
            elif length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                error = _too_large(self.max_body_bytes)
            if error is not None:
                from fastapi.responses import JSONResponse

                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Choice:
    """One choice of a request: its engine request, and the text side of its outputs
    (detokenized pieces that never split a character, stop strings that end the text and
    never go out split across pieces). Its events go to the response's queue:
    ("token", {token, text, logprob}) ..., then ("done", {...}) or ("error", {...})."""

    def __init__(self, index, ids, params, stop, top_logprobs, tokenizer, events, engine, metrics, route=None):
        self.index, self.ids, self.params, self.stop, self.top_logprobs = index, ids, params, stop, top_logprobs
        self.route = route  # where replicas are: the key that routes it (None: its prompt's first tokens)
        self.events, self.engine, self.metrics = events, engine, metrics
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer else None
        self.held = [""]  # text held back: a stop string's possible start
        self.rid = None
        self.tokens = 0
        self.cached_tokens = 0
        self.arrived = self.last = time.perf_counter()
        self.ended = False

    def submit(self) -> None:
        self.rid = self.engine.submit(self.ids, self.params, self.top_logprobs, self.on_output, route=self.route)
        _count(self.metrics, "prompt_tokens_total", len(self.ids))

    def cancel(self) -> None:
        if self.rid is not None and not self.ended:
            self.engine.abort(self.rid)
        self.ended = True

    def _put(self, kind, data) -> None:
        self.events.put_nowait((self.index, kind, data))

    def on_output(self, out) -> None:
        if self.ended:
            return
        _, token, logprob, reason, info = out
        now = time.perf_counter()
        if reason == "error":
            self.ended = True
            return self._put("error", info)
        if reason is not None:
            return self._done(reason, info.get("cached_tokens", self.cached_tokens))
        if self.tokens == 0:
            _observe(self.metrics, "time_to_first_token_seconds", now - self.arrived)
            if info is not None:
                self.cached_tokens = info["cached_tokens"]
                _observe(self.metrics, "request_queue_time_seconds", info["queue_s"])
        else:
            _observe(self.metrics, "inter_token_latency_seconds", now - self.last)
        self.last = now
        self.tokens += 1
        _count(self.metrics, "generation_tokens_total")
        lp = None if logprob is None else dict(logprob=logprob[0], top=logprob[1][: self.top_logprobs])
        text = self.decoder.push(token) if self.decoder else None
        if text is not None and self.stop:
            text, hit = _hold_stop(self.held, text, self.stop)
            if hit:
                self._put("token", dict(token=token, text=text, logprob=lp))
                self.engine.abort(self.rid)
                return self._done("stop", self.cached_tokens, at_stop_string=True)
        self._put("token", dict(token=token, text=text, logprob=lp))

    def _done(self, reason, cached_tokens, at_stop_string=False) -> None:
        self.ended = True
        # the text still held back: a stop string's possible start, a character's first bytes
        tail = "" if at_stop_string else self.held[0] + (self.decoder.flush() if self.decoder else "")
        _count(self.metrics, "request_success_total")
        _observe(self.metrics, "e2e_request_latency_seconds", time.perf_counter() - self.arrived)
        self._put("done", dict(finish_reason=reason, tail=tail, prompt_tokens=len(self.ids),
                               completion_tokens=self.tokens, cached_tokens=cached_tokens))


def _hold_stop(held: list[str], text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Stop strings across pieces: returns the text that may go out now and whether a stop
    string was reached. held[0] keeps the tail that could still begin a stop string."""
    buf = held[0] + text
    hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
    if hits:
        held[0] = ""
        return buf[: min(hits)], True
    keep = 0  # the longest tail of buf that is a prefix of some stop string
    for s in stops:
        for n in range(min(len(s) - 1, len(buf)), keep, -1):
            if buf.endswith(s[:n]):
                keep = n
                break
    held[0] = buf[len(buf) - keep :] if keep else ""
    return buf[: len(buf) - keep], False


def _observe(metrics, name: str, value: float) -> None:
    if metrics is not None:
        metrics[name].observe(value)


def _count(metrics, name: str, n: int = 1) -> None:
    if metrics is not None:
        metrics[name].inc(n)


def _stats_to_metrics(metrics):
    """The engine's stats (sent with each step's outputs) into the gauges and counters."""
    seen = dict(cache_queries=0, cache_hits=0)

    def update(stats: dict) -> None:
        metrics["num_requests_running"].set(stats["running"])
        metrics["state_slots_used"].set(stats["running"])
        metrics["num_requests_waiting"].set(stats["waiting"])
        for key, name in (("cache_queries", "prefix_cache_queries_total"), ("cache_hits", "prefix_cache_hits_total")):
            if stats[key] > seen[key]:
                metrics[name].inc(stats[key] - seen[key])
                seen[key] = stats[key]

    return update


class _Shape:
    """Builds OpenAI's response and chunk bodies from the engine's events, choice by choice."""

    def __init__(self, rid, model, chat, encoder, echoes):
        self.rid, self.model, self.chat, self.encoder = rid, model, chat, encoder
        self.created = int(time.time())
        self.texts = list(echoes)
        self.first = [True] * len(echoes)
        self.finish = [None] * len(echoes)
        self.logprobs = [[] for _ in echoes]
        self.usage = dict(prompt_tokens=0, completion_tokens=0, cached_tokens=0)
        self._templates: dict[int, list[str]] = {}

    def sse_chunk(self, index, piece: str, finish, logprob) -> str:
        """A stream chunk's server-sent event. A plain token's comes from a template made
        once a choice (its JSON with a marker where the text goes): a token's JSON costs a
        dumps of its text only, which matters at tens of streams a step."""
        if finish is not None or logprob is not None:
            return _sse(self.chunk(index, {"content": piece} if self.chat else piece, finish, logprob))
        template = self._templates.get(index)
        if template is None:
            mark = "\u0000text\u0000"
            body = _sse(self.chunk(index, {"content": mark} if self.chat else mark, None, None))
            template = self._templates[index] = body.split(json.dumps(mark))
        return template[0] + json.dumps(piece) + template[1]

    def add(self, index, kind, data):
        """One event -> (text piece, finish reason, logprob entry) for a chunk."""
        if kind == "done":
            self.finish[index] = data["finish_reason"]
            for key in self.usage:
                self.usage[key] += data[key]
            self.texts[index] += data["tail"]
            return data["tail"], data["finish_reason"], None
        piece = data["text"] or ""
        out = self.texts[index] + piece if self.first[index] else piece  # echo: the prompt goes out first
        self.texts[index] += piece
        self.first[index] = False
        entry = self._logprob(data) if data["logprob"] is not None else None
        if entry is not None:
            self.logprobs[index].append(entry)
        return out, None, entry

    def _token(self, t: int) -> str:
        return self.encoder.tokenizer.decode([t]) if self.encoder.tokenizer else str(t)

    def _logprob(self, data) -> dict:
        lp = data["logprob"]
        if self.chat:
            def one(t, v):
                s = self._token(t)
                return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8", "replace"))}

            return {**one(data["token"], lp["logprob"]), "top_logprobs": [one(t, v) for t, v in lp["top"]]}
        return {"token": self._token(data["token"]), "logprob": lp["logprob"],
                "top": {self._token(t): v for t, v in lp["top"]}}

    def _choice_logprobs(self, entries):
        if not entries:
            return None
        if self.chat:
            return {"content": entries}
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": offsets}

    def _usage(self):
        u = self.usage
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def response(self) -> dict:
        choices = []
        for i, text in enumerate(self.texts):
            c = {"index": i, "finish_reason": self.finish[i], "logprobs": self._choice_logprobs(self.logprobs[i])}
            c.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choices.append(c)
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage()}

    def chunk(self, index, delta, finish, logprob) -> dict:
        c = {"index": index, "finish_reason": finish, "logprobs": self._choice_logprobs([logprob] if logprob else [])}
        c.update({"delta": delta} if self.chat else {"text": delta})
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [c]}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage()}


# -- request parsing -------------------------------------------------------------------------


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit / 2**20:g} MiB (--max-body-mb)",
                    code="request_too_large")


def _generation_failed(data: dict) -> APIError:
    """The engine's "error" event as an API error: 503 when the server is shutting down, 500
    when the model failed (its weights overflow, say)."""
    status = data.get("status", 500)
    return APIError(status, data["message"] if status == 503 else f"generation failed: {data['message']}",
                    code="server_shutting_down" if status == 503 else None, kind="server_error")


def _engine_down() -> APIError:
    return APIError(503, "the engine is not running; the server cannot serve requests", code="engine_unavailable",
                    kind="server_error")


async def _json(request, limit: int) -> dict:
    chunks, size = [], 0
    async for chunk in request.stream():  # counted as it comes: a body without Content-Length too
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "an object"}


def _get(body: dict, name: str, kind, default=None, lo=None, hi=None, required=False):
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


def _check_model(body: dict, served: str) -> None:
    model = _get(body, "model", str, served)
    if model != served:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served}'", param="model",
                       code="model_not_found")


def _sampling(body: dict, vocab: int) -> SamplingParams:
    """The request's sampling fields; max_tokens is set per prompt by the caller."""
    top_k = _get(body, "top_k", int, 0)
    seed = _get(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**32:
        raise APIError(400, f"'seed' must be from 0 to 2^32 - 1, got {seed}", param="seed")
    stop_ids = _get(body, "stop_token_ids", list, None)
    if stop_ids:  # (an empty list: no stop tokens)
        _check_ids(stop_ids, vocab, "stop_token_ids")
    for name in ("max_tokens", "max_completion_tokens"):
        _get(body, name, int, None, lo=1)
    fields = dict(
        temperature=_get(body, "temperature", float, 1.0),
        top_k=0 if top_k == -1 else top_k, top_p=_get(body, "top_p", float, 1.0), min_p=_get(body, "min_p", float, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", float, 1.0), seed=seed, stop_token_ids=stop_ids,
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:  # "SamplingParams.<field> ...": name the request's field
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise APIError(400, str(e).replace("SamplingParams.", "", 1), param=field) from None


def _check_ids(ids: list, vocab: int, name: str) -> None:
    """The library's check of token ids (the first culprit named), as a 400 naming the field."""
    if not ids:
        raise APIError(400, f"'{name}' is empty", param=name)
    try:
        check_token_ids(ids, vocab, f"'{name}'")
    except ValueError as e:
        raise APIError(400, str(e), param=name) from None


def _encode(encoder, text: str, name: str) -> list[int]:
    try:
        ids = encoder.encode(text)
    except ValueError as e:
        raise APIError(400, f"'{name}': {e}", param=name) from None
    return ids


def _prompts(encoder, prompt) -> list[tuple[str, list[int]]]:
    """(text, ids) of each prompt: a string, a list of token ids, or a list of either."""
    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [(prompt, _encode(encoder, prompt, "prompt"))]
    if _is_ids(prompt):
        _check_ids(prompt, encoder.vocab_size, "prompt")
        return [(encoder.tokenizer.decode(prompt) if encoder.tokenizer else "", list(prompt))]
    # a batch: strings and lists of ids, one level deep, as OpenAI takes them
    if isinstance(prompt, list) and 0 < len(prompt) <= 64 and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return [p for item in prompt for p in _prompts(encoder, item)]
    raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of at most 64 of "
                   "those (strings or lists of token ids)", param="prompt")


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _chat_template(folder):
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


def _conversation_key(messages: list) -> int:
    """A conversation's routing key (deploy.py): its messages up to its first user message,
    which every later turn repeats, so that each turn goes to the replica that holds the
    state the turn before left."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
    opening = json.dumps(messages[: first + 1], sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(opening, digest_size=8).digest(), "little")


def _render_chat(template, messages) -> str:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        clean.append({"role": m["role"], "content": content})
    compiled, extra = template
    try:
        return compiled.render(messages=clean, add_generation_prompt=True, **extra)
    except Exception as e:  # a template's own error (raise_exception, a role it refuses)
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _listen(host: str, port: int):
    """The server's socket, bound before the model loads, so that a port in use or a host
    this machine does not have is one line naming the flag, at once."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host}: cannot be resolved ({e})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def folder_app(engine, folder, model_name: str, api_key: str | None, max_model_len: int, max_body_mb: float):
    """serve's app over `engine` for a checkpoint folder: its tokenizer and vocabulary for the
    prompts, its chat template, a metrics registry of its own (`fastmamba serve`'s, and each
    Ray Serve front end's)."""
    from fastmamba.io.files import inside
    from fastmamba.core.config import MambaConfig
    from fastmamba.io.tokenizer import Tokenizer

    folder = Path(folder)
    config = MambaConfig.from_file(inside(folder, "config.json"))
    prompts = PromptEncoder(Tokenizer(inside(folder, "tokenizer.json")), config.vocab_size, folder)
    registry, metrics = metrics_registry()
    return create_app(engine, prompts, model_name, api_key=api_key, max_model_len=max_model_len, registry=registry,
                      metrics=metrics, max_body_bytes=int(max_body_mb * 2**20))


def serve(args) -> int:
    """The CLI's `serve`: starts the engine process, then runs uvicorn until SIGTERM or
    Ctrl-C, which stop new requests, let running ones finish for --shutdown-timeout
    seconds, end the rest with a 503, and end the command with exit code 0."""
    import functools
    import sys

    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "zmq", "msgspec")):
        raise ValueError("serve needs the server packages: pip install 'fastmamba[serve]'")
    import uvicorn

    from fastmamba.engine.loader import checkpoint_folder, default_model_dir, load

    if args.replicas or args.autoscale:
        try:
            from fastmamba.serve.deploy import serve_replicas
        except ImportError:
            raise ValueError("--replicas and --autoscale need Ray Serve: pip install 'fastmamba[ray]'") from None
        return serve_replicas(args)
    sock = _listen(args.host, args.port)
    folder = checkpoint_folder(args.model)
    if not (folder / "tokenizer.json").exists():
        if not (folder / "config.json").exists() and args.model is None:
            raise ValueError(f"no bundled model in this install ({default_model_dir()}): pass --model DIR")
        raise ValueError(f"the model in {folder} has no tokenizer.json: give --model a folder with one")
    make_lm = functools.partial(load, str(folder), device=args.device, dtype=args.dtype, deterministic=args.deterministic,
                                threads=args.threads, state_dtype=args.state_dtype)
    print(f"fastmamba: starting the engine (loading {folder}{', capturing CUDA graphs' if args.device != 'cpu' else ''}) ...",
          file=sys.stderr, flush=True)
    engine = EngineClient(make_lm, dict(max_batch=args.max_batch, prefill_tokens=args.prefill_tokens,
                                        prefix_cache_bytes=args.prefix_cache_mb << 20), max_queue=args.max_queue)
    try:
        name = args.served_model_name or (args.model or "fastmamba-default")
        app = folder_app(engine, folder, name, api_key=args.api_key, max_model_len=args.max_model_len,
                         max_body_mb=args.max_body_mb)
        server_config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.shutdown_timeout + 5)
        info = engine.info
        print(f"fastmamba: serving {name} on http://{args.host}:{args.port} ({info['device']}, {info['dtype']}, "
              f"{info['max_batch']} slots)", file=sys.stderr, flush=True)
        _drained_server(server_config, engine, args.shutdown_timeout).run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0


def _drained_server(config, engine: EngineClient, drain_s: float):
    """uvicorn's server with a drain: the first SIGTERM or Ctrl-C stops new connections
    (uvicorn), lets running requests finish for `drain_s` seconds, then ends those still
    running with a 503 (engine.shutdown), so every connection closes and the command exits
    with 0. (uvicorn's own timeout, a little later, is the backstop: it cancels the tasks.)"""
    import uvicorn

    class Server(uvicorn.Server):
        draining = None

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn raises the caught signal again once it has shut down, which would end
            # the process by that signal: a drained shutdown ends with 0 instead
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()
            if self.draining is None:
                self.draining = threading.Timer(drain_s, engine.shutdown)
                self.draining.daemon = True
                self.draining.start()

    return Server(config)

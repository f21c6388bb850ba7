"""The OpenAI-compatible HTTP app over an engine client (engine/client.py: the engine
process, or Ray Serve replicas).

This process parses, validates, tokenizes, detokenizes (stop strings included), reads a
chat's tool calls (tools.py) and streams; the engine owns the model. Long texts and id
lists, and chats under the checkpoint's own template, are tokenized, detokenized and
rendered in worker processes (prompt_workers.py), so that the event loop (every stream,
/health) never waits on them. Endpoints: POST /v1/completions, /v1/chat/completions (both
with `stream`), GET /v1/models, /health, /metrics, POST /tokenize, /detokenize. Errors are
OpenAI's bodies (errors.py): 400 for a bad field (naming it), malformed or over-deep JSON,
an over-long prompt, a request that can never fit the queue or a chat template that fails
on it, 401 without the API key, 404 for an unknown model, 408 for a body that stalls, 413
for a body over the limit, 429 when the queue is full, 503 when the engine is gone, wedged
or shutting down; never a 500 for a client's mistake. No torch in this process.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from pathlib import Path

import msgspec

from fastmamba.engine.client import EngineClient, EngineRefused
from fastmamba.io.prompts import PromptEncoder
from fastmamba.serve import requests, tools
from fastmamba.serve.chat import ChatTemplate, TemplateRefused, check_messages, conversation_key
from fastmamba.serve.choices import Choice
from fastmamba.serve.errors import APIError, engine_down, from_engine, too_large
from fastmamba.serve.fields import check_fields
from fastmamba.serve.metrics import Metrics
from fastmamba.serve.options import ServeOptions
from fastmamba.serve.prompt_workers import PromptWorkers
from fastmamba.serve.requests import get, read_json
from fastmamba.serve.responses import Response, sse

MAX_N = 16
MAX_LOGPROBS = 20
DISCONNECT_CHECK_S = 0.25  # how often a non-streaming request looks for a client that hung up


class OpenAIServer:
    """The endpoints' work, over one engine client: each method takes the HTTP request and
    returns the response's body (or a streaming response)."""

    def __init__(self, engine: EngineClient, encoder: PromptEncoder, options: ServeOptions, metrics: Metrics):
        self.engine, self.encoder, self.options, self.metrics = engine, encoder, options, metrics
        self.model_name = options.model_name
        self.template = ChatTemplate(encoder.path, options.chat_template, options.chat_template_name)
        self.workers = PromptWorkers(encoder, self.template)
        self.created = int(time.time())
        engine.on_stats = metrics.update

    async def body(self, request) -> dict:
        return await read_json(request, self.options.max_body_bytes, self.options.client_timeout)

    async def while_connected(self, request, work):
        """`work`'s result, unless the client hangs up first: then `work` is cancelled (a
        prompt job still queued for a worker is dropped, not run for no one) and the
        request ends. Prompt work waits in one queue for few workers: a client that sent a
        long prompt and left must not make those behind it wait."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # (a task is cancelled only once it runs again: not work.cancelled() yet)
        if not work.done() or work.cancelled():
            raise APIError(499, "the client hung up while its prompt was prepared")
        return work.result()

    async def chat_prompt(self, request, messages: list[dict], tool_request: tools.ToolRequest | None = None
                          ) -> tuple[str, list[int]]:
        """The prompt text and ids of checked messages (chat.check_messages) and the request's
        tools, or a 400 naming the template (its own error, or a bound it went past)."""
        try:
            return await self.while_connected(request, self.workers.chat(
                messages, tool_request.tools if tool_request else None))
        except TemplateRefused as e:
            raise APIError(400, str(e), param="messages", code="chat_template_failed") from None
        except ValueError as e:
            raise APIError(400, f"'messages': {e}", param="messages") from None

    def _model(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fastmamba"}

    async def models(self):
        return {"object": "list", "data": [self._model()]}

    async def model(self, model: str):
        if model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return self._model()

    async def tokenize(self, request):
        from fastapi.responses import Response as HTTPResponse

        body = await self.body(request)
        check_fields(body, "tokenize")
        requests.check_model(body, self.model_name)
        if "messages" in body:
            if "prompt" in body:
                raise APIError(400, "give 'prompt' (a completion's) or 'messages' (a chat's), not both", param="prompt")
            messages = check_messages(body["messages"])
            _, ids = await self.chat_prompt(request, messages, self._tools(body))
        else:
            chat_only = sorted({"tools", "tool_choice", "parallel_tool_calls"} & body.keys())
            if chat_only:
                raise APIError(400, f"'{chat_only[0]}' goes with 'messages' (a chat's prompt), not 'prompt'",
                               param=chat_only[0])
            prompt = get(body, "prompt", str, required=True)
            ids = await self.while_connected(request, requests.encode(self.workers, prompt, "prompt"))
        # (encoded here: FastAPI's own encoder walks a long prompt's ids in Python, for seconds)
        return HTTPResponse(msgspec.json.encode({"tokens": ids, "count": len(ids)}), media_type="application/json")

    async def detokenize(self, request) -> dict:
        body = await self.body(request)
        check_fields(body, "detokenize")
        requests.check_model(body, self.model_name)
        ids = get(body, "tokens", list, required=True)
        requests.check_ids(ids, self.encoder.vocab_size, "tokens")
        if not self.encoder.tokenizer:
            return {"prompt": None}
        return {"prompt": await self.while_connected(request, self.workers.decode(ids))}

    async def completions(self, request):
        body = await self.body(request)
        check_fields(body, "completions")
        requests.check_model(body, self.model_name)
        prompts = await self.while_connected(request, requests.prompts(self.workers, body.get("prompt")))
        logprobs = get(body, "logprobs", int, None, lo=0, hi=MAX_LOGPROBS)
        echo = get(body, "echo", bool, False)
        max_tokens = get(body, "max_tokens", int, 16)  # OpenAI's default for completions
        return await self._serve(request, body, prompts, chat=False, top_logprobs=logprobs, echo=echo,
                                 max_tokens=max_tokens)

    async def chat(self, request):
        body = await self.body(request)
        check_fields(body, "chat")
        requests.check_model(body, self.model_name)
        messages = check_messages(body.get("messages"))
        tool_request = self._tools(body)
        prompts = [await self.chat_prompt(request, messages, tool_request)]
        top = get(body, "top_logprobs", int, 0, lo=0, hi=MAX_LOGPROBS)
        top_logprobs = top if get(body, "logprobs", bool, False) else None
        # max_completion_tokens is OpenAI's current name, max_tokens the older one; without
        # either, a reply runs until a stop or --max-model-len
        max_tokens = get(body, "max_tokens", int, None)
        newer = get(body, "max_completion_tokens", int, None)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise APIError(400, f"'max_completion_tokens' ({newer}) and 'max_tokens' ({max_tokens}) disagree: "
                           "give one of them", param="max_completion_tokens")
        max_tokens = newer if newer is not None else max_tokens
        return await self._serve(request, body, prompts, chat=True, top_logprobs=top_logprobs, echo=False,
                                 max_tokens=max_tokens, route=conversation_key(messages), tool_request=tool_request)

    def _tools(self, body: dict) -> tools.ToolRequest | None:
        return tools.read(body, self.template.uses_tools, self.template.tools_origin)

    @property
    def max_model_len(self) -> int:
        """The most tokens of a prompt and its output: --max-model-len, or less where the
        engine's KV cache holds less a request."""
        return min(self.options.max_model_len, self.engine.context or self.options.max_model_len)

    def _check_lengths(self, prompts, max_tokens: int | None) -> None:
        limit = self.max_model_len
        why = "--max-model-len" if limit == self.options.max_model_len else "what its KV cache holds a request"
        for _, ids in prompts:
            if len(ids) >= limit:
                raise APIError(400, f"the prompt has {len(ids)} tokens, and this server's limit for prompt + max_tokens "
                               f"is {limit} ({why})", param="prompt", code="context_length_exceeded")
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(400, f"max_tokens {max_tokens} + the prompt's {len(ids)} tokens is over this server's "
                               f"limit of {limit} ({why})", param="max_tokens", code="context_length_exceeded")

    async def _serve(self, request, body, prompts, chat: bool, top_logprobs, echo: bool, max_tokens: int | None,
                     route: int | None = None, tool_request: tools.ToolRequest | None = None):
        n = get(body, "n", int, 1, lo=1, hi=MAX_N)
        stream = get(body, "stream", bool, False)
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)  # (checked: fields.py)
        stop = get(body, "stop", (str, list), None)
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "stop must be a string or a list of non-empty strings", param="stop")
        get(body, "user", str, None)
        fields = requests.sampling_fields(body, self.encoder.vocab_size, tool_request and tool_request.guide)
        requests.sampling_params(fields)  # a bad value is the client's first error (each choice's are made below)
        self._check_lengths(prompts, max_tokens)
        capacity, asked = self.engine.capacity, len(prompts) * n
        if capacity is not None and asked > capacity:
            raise APIError(400, f"this request asks for {asked} completions ({len(prompts)} prompt(s), n={n}) and this "
                           f"server holds at most {capacity} at once (its state slots and --max-queue): it can never "
                           "be taken; ask for fewer", param="n")
        events: asyncio.Queue = asyncio.Queue()
        choices = []
        for _, ids in prompts:
            for k in range(n):  # choice k takes seed + k
                seed = None if fields["seed"] is None else (fields["seed"] + k) % 2**32
                limit = max_tokens if max_tokens is not None else self.max_model_len - len(ids)
                params = requests.sampling_params(fields, seed=seed, max_tokens=limit)
                choices.append(Choice(len(choices), ids, params, stop, top_logprobs, self.encoder.tokenizer, events,
                                      self.engine, self.metrics, route))
        try:
            for c in choices:
                c.submit()
        except EngineRefused as e:
            for c in choices:
                c.cancel()
            raise from_engine(e.error) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        echoes = [prompts[i // n][0] if echo else "" for i in range(len(choices))]
        response = Response(rid, self.model_name, chat, self.encoder, echoes, n, tool_request)
        if stream:
            from fastapi.responses import StreamingResponse

            return StreamingResponse(self._stream(choices, events, response, include_usage),
                                     media_type="text/event-stream")
        return await self._collect(request, choices, events, response)

    async def _collect(self, request, choices, events, response: Response):
        from fastapi.responses import JSONResponse

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
                    raise from_engine(data, response.tools and response.tools.field)
                response.add(index, kind, data)
                done += kind == "done"
        finally:
            for c in choices:
                c.cancel()
        return response.response()

    async def _stream(self, choices, events, response: Response, include_usage: bool):
        done = 0
        try:
            if response.chat:
                for i in range(len(choices)):
                    yield sse(response.chunk(i, response.first_delta(i), None, None))
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
                        out.append(sse(from_engine(data, response.tools and response.tools.field).body()))
                        failed = True
                        break
                    piece, finish, logprob = response.add(index, kind, data)
                    # a chunk for every token, its text empty where the token ends no character
                    # (or the model has no tokenizer): clients count and time tokens by chunks
                    if kind == "token" or piece or finish:
                        out.append(response.sse_chunk(index, piece, finish, logprob))
                    done += kind == "done"
                yield "".join(out)
            if include_usage:
                yield sse(response.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:  # a client that went away cancels its requests and frees their slots
            for c in choices:
                c.cancel()


async def _disconnect(request) -> None:
    """Returns when the client of `request`, its body read, hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        # (uvicorn's receive waits for the disconnect; a server whose receive answers at
        # once is asked again on a clock, not in a spin)
        await asyncio.sleep(DISCONNECT_CHECK_S)


def create_app(engine: EngineClient, encoder: PromptEncoder, options: ServeOptions, metrics: Metrics | None = None):
    """The FastAPI app over a running engine; `encoder` encodes prompts with the checkpoint's
    tokenizer (its path: the chat template's folder); a metrics registry of its own unless
    given."""
    import contextlib

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.responses import Response as HTTPResponse
    from starlette.exceptions import HTTPException

    metrics = metrics or Metrics()
    server = OpenAIServer(engine, encoder, options, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        server.workers.close()

    app = FastAPI(title="fastmamba", docs_url=None, redoc_url=None, lifespan=lifespan)

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def api_error(_, e: APIError):  # (handlers async: a plain one would run in a thread)
        return error(e)

    async def http_error(_, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error(APIError(e.status_code, str(e.detail), code=code))

    async def validation_error(_, e: RequestValidationError):
        return error(APIError(400, str(e)))

    async def server_error(_, e: Exception):
        return error(APIError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    for kind, handler in ((APIError, api_error), (HTTPException, http_error), (RequestValidationError, validation_error),
                          (Exception, server_error)):
        app.add_exception_handler(kind, handler)
    app.add_middleware(_Gate, api_key=options.api_key, max_body_bytes=options.max_body_bytes)

    @app.get("/health")
    async def health():
        return {"status": "ok"} if engine.alive else error(engine_down())

    @app.get("/metrics")
    async def metrics_page():
        page, content_type = metrics.page()
        return HTTPResponse(page, media_type=content_type)

    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model:path}")(server.model)  # (a hub id has a slash)
    for path, endpoint in (("/tokenize", server.tokenize), ("/detokenize", server.detokenize),
                           ("/v1/completions", server.completions), ("/v1/chat/completions", server.chat)):
        app.post(path)(_taking_request(endpoint, HTTPRequest))
    return app


def _taking_request(endpoint, request_type):
    """An endpoint FastAPI hands the raw request to (the body is read and checked by hand)."""
    async def route(request):
        return await endpoint(request)

    route.__annotations__ = {"request": request_type}  # (the class itself: FastAPI reads it to pass the request)
    route.__name__ = endpoint.__name__
    return route


class _Gate:
    """What a request must pass before FastAPI reads it: the API key (not on /health), and a
    Content-Length within the body limit (413 before a byte of the body is read; read_json
    also counts the bytes of a body sent without one). A response that goes out before its
    request's body was read to the end (those two, a 408 or 413 mid-body, a 404 for a POST)
    says `connection: close`, and uvicorn closes the connection once it is sent: the unread
    rest would keep the connection open with no timer (uvicorn's keep-alive timer stops
    at each byte that comes, and restarts only when a response ends). Plain ASGI:
    Starlette's @app.middleware hides a client's disconnect from the endpoint, and a
    request whose client hung up must be cancelled."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.key = api_key.encode() if api_key else None

    def _authorized(self, header: bytes | None) -> bool:
        """`Authorization: Bearer KEY`, the scheme in any case (RFC 9110: schemes are
        case-insensitive), the key compared in constant time."""
        scheme, _, token = (header or b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive_message, send_message):
        receive, send = receive_message, send_message
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            body_unread = (length is not None and length != b"0") or b"transfer-encoding" in headers

            async def reading():
                nonlocal body_unread
                message = await receive_message()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_unread = False  # (all of it came, or the client left)
                return message

            async def sending(message):
                if message["type"] == "http.response.start" and body_unread:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
                await send_message(message)

            receive, send = reading, sending
            error = None
            if self.key is not None and scope["path"] != "/health" and not self._authorized(headers.get(b"authorization")):
                error = APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
            elif length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                error = too_large(self.max_body_bytes)
            if error is not None:
                from fastapi.responses import JSONResponse

                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def folder_app(engine: EngineClient, folder, options: ServeOptions):
    """serve's app over `engine` for a checkpoint folder: its tokenizer and vocabulary for the
    prompts, its chat template (`fastmamba serve`'s, and each Ray Serve front end's)."""
    from fastmamba.core.config import MambaConfig
    from fastmamba.io.files import inside
    from fastmamba.io.tokenizer import Tokenizer

    folder = Path(folder)
    config = MambaConfig.from_file(inside(folder, "config.json"))
    encoder = PromptEncoder(Tokenizer(inside(folder, "tokenizer.json")), config.vocab_size, folder)
    return create_app(engine, encoder, options)

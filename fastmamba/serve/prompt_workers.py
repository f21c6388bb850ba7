"""Prompt work too long or too untrusted for the event loop, in worker processes: tokenizing
long texts, detokenizing long lists of ids, and rendering (then tokenizing) a chat with the
checkpoint's own template.

The tokenizer holds the interpreter lock while it encodes (about a second a megabyte), so
a thread would still stall every stream and /health: the work goes to processes. Short
inputs stay on the event loop, where they cost less than a trip to a worker. A chat
template from the checkpoint folder renders under a size bound (chat.ChatTemplate.render)
and a time bound: a worker past it is killed and replaced, and the request gets a 400
naming the template. A worker found dead (killed while idle) is replaced before it is given
a job; a tokenizer job whose worker dies on it is a 503 (not run again: it may be what
killed it).
A worker ends with its server, however the server ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import queue
import signal

from fastmamba.io.prompts import PromptEncoder
from fastmamba.serve.chat import ChatTemplate, TemplateRefused, render_limit
from fastmamba.serve.errors import APIError

INLINE_TEXT_CHARS = 4096  # a text this short is tokenized on the event loop (a few ms at most)
INLINE_IDS = 16384  # ids this few are detokenized on the event loop (about a ms)
RENDER_TIMEOUT_S = 5.0  # a chat template's time to render and tokenize a request's messages
WORKER_MEMORY_BYTES = 4 << 30  # the address space a worker may add to what it starts with
RECYCLE_RSS_BYTES = 512 << 20  # a worker left holding more (a long prompt's ids, say) is replaced


def _worker_main(conn, tokenizer_path, vocab_size: int, folder, template_arguments: tuple) -> None:
    """A worker: answers (op, arg) jobs on its pipe with ("ok", result) or (kind, message),
    kind "value" (a ValueError: the input's fault), "template" (the template refused) or
    "error". `template_arguments`: the server's ChatTemplate's, to make the same one."""
    from fastmamba.engine.process import exit_with_parent
    from fastmamba.io.tokenizer import Tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the server decides
    exit_with_parent()
    _limit_memory()
    encoder = PromptEncoder(Tokenizer(tokenizer_path) if tokenizer_path else None, vocab_size, folder)
    template = None
    while True:
        try:
            op, arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "encode":
                result = encoder.encode(*arg)
            elif op == "decode":
                result = encoder.tokenizer.decode(arg)
            else:  # "chat": checked messages and the request's tools
                template = template or ChatTemplate(*template_arguments)
                messages, tools = arg
                text = template.render(messages, render_limit(messages, tools), tools)
                result = (text, encoder.encode(text, add_special_tokens=False))
            reply = ("ok", result)
        except ValueError as e:
            reply = ("value", str(e))
        except TemplateRefused as e:
            reply = ("template", str(e))
        except MemoryError:
            reply = ("error", "out of memory")
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        del reply, arg


def _limit_memory() -> None:
    """Bounds the worker's address space (a runaway template gets a MemoryError, not the
    machine's memory), where the platform has the limit."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = size + WORKER_MEMORY_BYTES
        if hard == resource.RLIM_INFINITY or want < hard:
            resource.setrlimit(resource.RLIMIT_AS, (want if soft == resource.RLIM_INFINITY else min(soft, want), hard))
    except (ImportError, OSError, ValueError):
        pass


class WorkerFailed(Exception):
    """A worker's job ended without an answer: it ran past its time (the worker was killed)
    or the worker died. `timed_out` tells which."""

    def __init__(self, timed_out: bool):
        super().__init__("timed out" if timed_out else "the worker died")
        self.timed_out = timed_out


class _Worker:
    def __init__(self, ctx, args):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, *args), name="fastmamba-prompts", daemon=True)
        self.proc.start()
        child.close()

    def call(self, job, timeout: float | None):
        self.conn.send(job)
        if not self.conn.poll(timeout):
            raise WorkerFailed(timed_out=True)
        return self.conn.recv()

    def rss(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class PromptWorkers:
    """`count` worker processes for one checkpoint's tokenizer and chat template. Each job
    takes an idle worker; a worker that runs past its job's time is killed and replaced."""

    def __init__(self, encoder: PromptEncoder, template: ChatTemplate, count: int | None = None,
                 render_timeout: float = RENDER_TIMEOUT_S):
        self.encoder, self.template, self.render_timeout = encoder, template, render_timeout
        tokenizer = encoder.tokenizer
        self._args = (str(tokenizer.path) if tokenizer is not None else None, encoder.vocab_size,
                      None if encoder.path is None else str(encoder.path), template.arguments)
        self._ctx = multiprocessing.get_context("spawn")
        count = count or min(2, os.cpu_count() or 1)  # (a long prompt takes a worker up to 2 GB)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self._idle.put(_Worker(self._ctx, self._args))
        # a thread per worker waits on its pipe: a job the event loop stops awaiting (its
        # client left) still gives its worker back when it ends
        self._threads = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="fastmamba-prompts")
        self._closed = False

    def _call(self, job, timeout):
        worker = self._idle.get()
        try:
            if not worker.proc.is_alive():  # it died while idle (killed, say): its replacement takes the job
                worker = self._replaced(worker)
            # (one that dies on the job is not given it again: the job may be what killed it,
            # a prompt that ran it out of memory)
            kind, value = worker.call(job, timeout)
            if worker.rss() > RECYCLE_RSS_BYTES:  # (Python keeps a long job's memory)
                worker = self._replaced(worker)
        except (WorkerFailed, EOFError, OSError) as e:
            worker = self._replaced(worker)
            if isinstance(e, WorkerFailed):
                raise
            raise WorkerFailed(timed_out=False) from None
        finally:
            self._idle.put(worker)
        if kind != "ok":
            raise {"value": ValueError, "template": TemplateRefused}.get(kind, RuntimeError)(value)
        return value

    def _replaced(self, worker: _Worker) -> _Worker:
        worker.kill()
        return _Worker(self._ctx, self._args)

    async def _run(self, job, timeout=None):
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, job, timeout)

    async def _tokenizer_job(self, job):
        try:
            return await self._run(job)
        except WorkerFailed:
            raise APIError(503, "the worker process tokenizing this request died on it (out of memory, or "
                           "killed); try again", code="prompt_worker_failed", kind="server_error") from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (PromptEncoder.encode's, and its ValueErrors)."""
        if len(text) <= INLINE_TEXT_CHARS:
            return self.encoder.encode(text, add_special_tokens)
        return await self._tokenizer_job(("encode", (text, add_special_tokens)))

    async def decode(self, ids: list[int]) -> str:
        if len(ids) <= INLINE_IDS:
            return self.encoder.tokenizer.decode(ids)
        return await self._tokenizer_job(("decode", ids))

    async def chat(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[int]]:
        """The prompt of checked messages (and the request's tools) and its ids. Raises
        TemplateRefused (naming the template) and the encoder's ValueError."""
        if self.template.builtin:  # (its cost is known: only a long prompt's tokenizing leaves the loop)
            text = self.template.render(messages, render_limit(messages, tools), tools)
            return text, await self.encode(text)  # (it writes no special tokens: the tokenizer's, as a text prompt's)
        try:
            return await self._run(("chat", (messages, tools)), self.render_timeout)
        except WorkerFailed as e:
            if e.timed_out:
                raise TemplateRefused(f"{self.template.origin_for(tools)} took over {self.render_timeout:g} s to render these "
                                      "messages: refused") from None
            raise TemplateRefused(f"{self.template.origin_for(tools)} failed on these messages: its renderer ran out of "
                                  "memory or crashed") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break

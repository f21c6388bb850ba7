"""The serving engine: one thread that owns the model and runs a loop of steps over a fixed
pool of state slots (continuous batching).

Each step:
1. frees the slots of finished and cancelled requests, and admits waiting requests into free
   slots (a prefix-cache hit copies the cached state into the slot);
2. prefills admitted prompts in chunks within a token budget (`prefill_tokens` a step), so
   that running streams keep their pace behind a long prompt;
3. decodes every running request together, one token each, on the pool's first slots in
   place (the decoding requests are moved there), and samples every request's token in one
   call, each with its own parameters and random stream, as `generate` would alone.
On the GPU engine the decode step and the prefill chunks replay CUDA graphs captured when
the engine is built (cuda_graphs.PoolDecodeGraphs, cuda_graphs.ChunkPrefillGraphs): launched from
Python, a 2.8b step is hundreds of kernel launches, which cost more than the GPU's work.
Requests talk to the caller only through their `emit` callback (tokens with their text,
then one "done" or "error"); one request's failure never reaches another.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from .cuda_graphs import HostTokens
from .model import MambaState
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, SlotParams, pick_sampler, resolve_seed
from .tokenizer import IncrementalDecoder


class QueueFull(Exception):
    pass


@dataclass
class Request:
    ids: list[int]
    params: SamplingParams
    emit: Callable[[str, dict], None]  # ("token", {...}) ..., then ("done", {...}) or ("error", {...})
    stop: tuple[str, ...] = ()  # stop strings: generation ends before the first one, never split
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k best
    id: int = field(default_factory=itertools.count().__next__)
    arrived: float = field(default_factory=time.perf_counter)
    # -- the engine's, while the request runs --
    slot: int | None = None
    pos: int = 0  # prompt tokens prefilled so far
    cached_tokens: int = 0
    generated: int = 0
    last_token: int | None = None  # the input of the next decode step
    cancelled: bool = False
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None


class Engine:
    def __init__(self, lm, max_batch: int = 16, max_queue: int = 256, prefill_tokens: int = 1024,
                 prefix_cache_bytes: int = 256 << 20, metrics=None):
        self.lm, self.model = lm, lm.model
        self.max_batch, self.max_queue, self.prefill_tokens = max_batch, max_queue, prefill_tokens
        self.cache = PrefixCache(prefix_cache_bytes)
        self.metrics = metrics
        self.pool = self.model.new_state(max_batch)  # one slot a running request
        self.slots: list[Request | None] = [None] * max_batch
        self.slot_params = SlotParams.empty(max_batch, self.model.config.vocab_size, self.model.device)
        self.waiting: queue.Queue[Request] = queue.Queue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fastmamba-engine", daemon=True)
        self._sampling: dict[int, tuple[set[int], IncrementalDecoder | None, list[str]]] = {}
        self.decode_graphs = self.prefill_graphs = None
        if lm.engine == "triton":
            from .cuda_graphs import ChunkPrefillGraphs, PoolDecodeGraphs

            self.decode_graphs = PoolDecodeGraphs(self.model, self.pool, lm.deterministic)
            self.prefill_graphs = ChunkPrefillGraphs(self.model, self.cache.interval)

    # -- the caller's side (any thread) -----------------------------------------------------

    def start(self) -> "Engine":
        # The engine thread shares the interpreter with the HTTP side; at Python's default
        # 5 ms switch interval a step ready to launch could wait that long for the lock.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stops the engine thread; requests still queued or running end with an error."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        for r in list(self.slots) + list(self.waiting.queue):
            if r is not None:
                self._fail(r, "the server is shutting down", status=503)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and takes requests."""
        return self._thread.is_alive() and not self._stop

    def submit(self, req: Request) -> None:
        """Queues a request; QueueFull when `max_queue` are waiting already."""
        if self.waiting.qsize() >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests are waiting already")
        self.waiting.put(req)
        self._gauge("num_requests_waiting", self.waiting.qsize())
        self._wake.set()

    def cancel(self, req: Request) -> None:
        """The client went away: the request's slot is freed at the next step."""
        req.cancelled = True
        self._wake.set()

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode(), self.lm._threads():
            while not self._stop:
                if not self.running and self.waiting.empty():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                try:
                    self._step()
                except Exception as e:  # a fault of the step itself: fail what runs, keep serving
                    for r in self.slots:
                        if r is not None:
                            self._fail(r, f"{type(e).__name__}: {e}")

    def _step(self) -> None:
        for i, r in enumerate(self.slots):
            if r is not None and (r.cancelled or r.finished):
                self._free(i)
        self._admit()
        self._prefill()
        self._decode()

    def _gauges(self) -> None:
        self._gauge("num_requests_running", self.running)
        self._gauge("state_slots_used", self.running)
        self._gauge("num_requests_waiting", self.waiting.qsize())

    def _admit(self) -> None:
        while not self.waiting.empty() and None in self.slots:
            r = self.waiting.get()
            if r.cancelled:
                continue
            # new requests take the highest free slot: the decoding ones gather at the
            # lowest, so the padding rows of a decode bucket are rarely anyone's
            i = max(k for k, s in enumerate(self.slots) if s is None)
            r.slot = i
            self.slots[i] = r
            self._gauges()
            self._observe("request_queue_time_seconds", time.perf_counter() - r.arrived)
            try:
                self._begin(r)
            except Exception as e:
                self._fail(r, f"{type(e).__name__}: {e}")

    def _begin(self, r: Request) -> None:
        params = r.params
        self.slot_params.set_slot(r.slot, params, resolve_seed(params.seed), r.ids)
        stops = set(params.stop_token_ids) if params.stop_token_ids is not None else {self.model.config.eos_token_id}
        decoder = IncrementalDecoder(self.lm.tokenizer) if self.lm.tokenizer else None
        self._sampling[r.id] = (stops, decoder, [""])
        self._count("prompt_tokens_total", len(r.ids))
        self.pool.reset(r.slot)
        self._count("prefix_cache_queries_total")
        n, hit = self.cache.lookup(r.ids)
        if hit is not None:
            self._count("prefix_cache_hits_total")
            self.pool.conv[:, r.slot : r.slot + 1].copy_(hit.conv)
            self.pool.ssm[:, r.slot : r.slot + 1].copy_(hit.ssm)
            r.pos = r.cached_tokens = n
            if n == len(r.ids):
                self._sample_one(r, hit.logits[None])

    def _slot_state(self, i: int) -> MambaState:
        return MambaState(self.pool.conv[:, i : i + 1], self.pool.ssm[:, i : i + 1])

    def _prefill(self) -> None:
        budget = self.prefill_tokens
        # oldest first, each as far as the budget goes: the earliest request's first token comes first
        for r in sorted((r for r in self.slots if r is not None), key=lambda r: r.arrived):
            try:
                while budget > 0 and not r.finished and r.pos < len(r.ids):
                    # chunks end on the cache's interval grid, so a prefix hit resumes exactly
                    # where a cold prefill would cut
                    grid = (r.pos // self.cache.interval + 1) * self.cache.interval
                    end = min(len(r.ids), r.pos + budget, grid)
                    chunk = torch.tensor([r.ids[r.pos : end]], device=self.model.device)
                    view = self._slot_state(r.slot)
                    if self.prefill_graphs is not None:
                        logits = self.prefill_graphs(chunk, view)  # (1, V)
                    else:
                        logits = self.model.prefill(chunk, view, last_only=True)
                    budget -= end - r.pos
                    r.pos = end
                    if end == len(r.ids) or end % self.cache.interval == 0:
                        self.cache.store(r.ids[:end], view.conv, view.ssm, logits[0])
                    if end == len(r.ids):
                        self.model.check_finite(logits, [r.ids])
                        self._sample_one(r, logits)
            except Exception as e:
                self._fail(r, f"{type(e).__name__}: {e}")
            if budget <= 0:
                break

    def _decoding(self, r: Request | None) -> bool:
        return r is not None and not r.finished and not r.cancelled and r.last_token is not None

    def _move(self, src: int, dst: int) -> None:
        """Swaps two slots: their requests, state rows and sampling rows (either may be free)."""
        a, b = self.slots[src], self.slots[dst]
        for t in (self.pool.conv, self.pool.ssm):
            _swap(t[:, src], t[:, dst])
        for f in fields(self.slot_params):
            t = getattr(self.slot_params, f.name)
            _swap(t[src], t[dst])
        self.slots[src], self.slots[dst] = b, a
        for r, i in ((a, dst), (b, src)):
            if r is not None:
                r.slot = i

    def _decode(self) -> None:
        # The decoding requests move to the first slots, so that the step runs on the
        # pool's first d rows in place (views of it: no gather, no scatter).
        d = sum(self._decoding(r) for r in self.slots)
        if not d:
            return
        holes = [i for i in range(d) if not self._decoding(self.slots[i])]
        movers = [i for i in range(d, self.max_batch) if self._decoding(self.slots[i])]
        for hole, mover in zip(holes, movers):
            self._move(mover, hole)
        rows = self.slots[:d]
        last = [r.last_token for r in rows]
        if self.decode_graphs is None:
            logits = self.model.step(torch.tensor(last, device=self.model.device),
                                     MambaState(self.pool.conv[:, :d], self.pool.ssm[:, :d]))
        else:
            # the rows between d and the bucket are padding: keep aside any that hold a
            # request still prefilling
            bucket = self.decode_graphs.bucket(d)
            kept = [(i, self.pool.conv[:, i].clone(), self.pool.ssm[:, i].clone())
                    for i in range(d, bucket) if self.slots[i] is not None]
            logits = self.decode_graphs(last)
            for i, conv, ssm in kept:
                self.pool.conv[:, i].copy_(conv)
                self.pool.ssm[:, i].copy_(ssm)
        sampler = pick_sampler([r.params for r in rows], self.lm.engine == "triton")
        # the step's one wait, on an event, which lets the HTTP side run meanwhile (a wait
        # inside .tolist() would hold the interpreter's lock until the GPU is done)
        tokens = HostTokens(sampler(logits[:d], self.slot_params.rows(0, d))).tolist()
        for k, r in enumerate(rows):
            try:
                self._accept(r, tokens[k], logits[k])
            except Exception as e:
                self._fail(r, f"{type(e).__name__}: {e}")

    def _sample_one(self, r: Request, logits: torch.Tensor) -> None:
        """The first token of a request whose prompt is prefilled, from logits (1, V)."""
        sampler = pick_sampler([r.params], self.lm.engine == "triton")
        self._accept(r, int(sampler(logits, self.slot_params.rows(r.slot, r.slot + 1))[0]), logits[0])

    def _accept(self, r: Request, token: int, logits: torch.Tensor) -> None:
        """The request's sampled token (from logits (V,)), with its text; finishes it at a stop."""
        stops, decoder, held = self._sampling[r.id]
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
            self._observe("time_to_first_token_seconds", now - r.arrived)
        else:
            self._observe("inter_token_latency_seconds", now - r.last_token_at)
        r.last_token_at = now
        r.last_token = token
        if token in stops:
            return self._finish(r, "stop")
        r.generated += 1
        self._count("generation_tokens_total")
        logprob = self._logprobs(logits, token, r.top_logprobs) if r.top_logprobs is not None else None
        text = decoder.push(token) if decoder else None
        if text is not None and r.stop:
            text, hit = _hold_stop(held, text, r.stop)
            if hit:
                r.emit("token", dict(token=token, text=text, logprob=logprob))
                return self._finish(r, "stop", at_stop_string=True)
        r.emit("token", dict(token=token, text=text, logprob=logprob))
        if r.generated >= r.params.max_tokens:
            self._finish(r, "length")

    def _logprobs(self, logits: torch.Tensor, token: int, k: int) -> dict:
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(lp, k) if k else None
        return dict(logprob=float(lp[token]), top=[] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))

    def _finish(self, r: Request, reason: str, at_stop_string: bool = False) -> None:
        if r.finished:
            return
        _, decoder, held = self._sampling[r.id]
        # the text still held back: a stop string's possible start, a character's first bytes
        tail = "" if at_stop_string else held[0] + (decoder.flush() if decoder else "")
        r.finished = True
        self._count("request_success_total")
        self._observe("e2e_request_latency_seconds", time.perf_counter() - r.arrived)
        r.emit("done", dict(finish_reason=reason, tail=tail, prompt_tokens=len(r.ids), completion_tokens=r.generated,
                            cached_tokens=r.cached_tokens))

    def _fail(self, r: Request, message: str, status: int = 500) -> None:
        if not r.finished:
            r.finished = True
            r.emit("error", dict(message=message, status=status))

    def _free(self, i: int) -> None:
        r = self.slots[i]
        self._sampling.pop(r.id, None)
        self.slots[i] = None
        self._gauges()

    # -- metrics (optional) -------------------------------------------------------------------

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics[name].observe(value)

    def _count(self, name: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics[name].inc(n)

    def _gauge(self, name: str, value: int) -> None:
        if self.metrics is not None:
            self.metrics[name].set(value)


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    row = a.clone()
    a.copy_(b)
    b.copy_(row)


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

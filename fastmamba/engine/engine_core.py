"""The engine core: every generation runs here. `generate`, `stream` and `generate_batch`
drive it in the caller's process (language_model.py, through client.InProcessClient);
`serve` runs it in a process of its own (process.py). It is one loop of steps over a fixed
pool of state slots (continuous batching), and it knows token ids only: text, stop strings
and HTTP live in its callers. Requests come in and outputs go out as protocol.py's
messages.

A step:
1. frees the slots of finished and aborted requests and admits waiting ones into free
   slots (a prefix-cache hit copies the cached state into the slot);
2. prefills prompts within a token budget (so that running streams keep their pace behind
   long prompts): new prompts together in one left-padded pass; prompts that resume from
   a cached state, and long prompts, in chunks on the cache's grid (512 tokens; 2048 for the
   GPU's eager prefill, a hybrid's), the chunks of one length together;
3. launches one decode step for every running request, on the pool's first rows in place,
   and samples each request's next token on the device with its own parameters and random
   stream, as `generate` alone would;
4. then reads the tokens of the step before. On the GPU the host is a step ahead: step t+1
   is queued before step t's tokens are read, so the GPU runs on while the host handles
   them (stops, outputs). A row whose request turns out to have finished at step t has
   run one step too many, which is discarded. On the CPU a step queued ahead is a step
   computed, so there each step's tokens are read at once.
A guided request's rows are sampled from the tokens its grammar allows (its matcher fills a
bitmask on the host, which the sampler reads beside the logits; the other rows untouched,
the logits themselves unmasked), and each token it reads goes through its
matcher; the grammar complete, the request ends ("stop"). A guided row's mask needs the
token before, so where a step decodes one, the step before's tokens are read between its
decode pass's launch and its sampling: the host reads them and fills the masks while the
GPU runs the pass, and the step ahead is kept.
The decode input of a row is the token it sampled last, kept on the device: the host's
reading of it is never on the GPU's path.

Every sampled token feeds the slot's state exactly once (`RunningRequest.fed` counts them),
so when a request finishes its slot holds the state after its prompt and output: the
prefix cache keeps it there, where a chat's next turn starts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import fields

import torch

from fastmamba.core.errors import NonFiniteError
from fastmamba.core.kv_cache import KVCache
from fastmamba.core.model import Mamba
from fastmamba.core.ops import REFERENCE_OPS
from fastmamba.core.sampling import SlotParams, masked, pick_sampler
from fastmamba.core.sampling_params import resolve_seed
from fastmamba.core.state import MambaState
from fastmamba.core.transfer import to_device
from fastmamba.engine import protocol, warm_up
from fastmamba.engine.cpu_threads import cpu_threads
from fastmamba.engine.cuda_graphs import (
    CHUNK_BATCHES,
    PREFILL_BUCKETS,
    ChunkPrefillGraphs,
    PoolDecodeGraphs,
)
from fastmamba.engine.guides import GuideError, Guides, token_bitmask
from fastmamba.engine.plan import SAMPLER_TILES
from fastmamba.engine.prefill import Prefill
from fastmamba.engine.prefix_cache import EAGER_INTERVAL, INTERVAL, PrefixCache
from fastmamba.engine.protocol import (
    EngineError,
    Failed,
    Finished,
    FirstToken,
    Stats,
    Token,
)
from fastmamba.engine.running import Launch, RunningRequest, logprobs_of


class EngineCore:
    """The slots, the waiting queue, the prefix cache and the step loop (see the module's doc).

    model: the model (its ops: the reference's or the GPU's); prefill: its prefill of new
    prompts (whose `graphs` says whether this is the GPU engine, with CUDA graphs for the
    decode step too, and whose `deterministic` the decode step follows).
    max_batch: state slots. prefill_tokens: prompt tokens prefilled a step at most (a longer
    prompt runs in chunks over several steps). prefix_cache_bytes: the prefix cache's budget
    (0: off, as offline; serve's is 256 MiB). threads: PyTorch's CPU threads while a step
    computes (cpu_threads.py; 0: as PyTorch has it). decode_plan: a DecodePlan (plan.py) for
    the decode step at every batch size, in place of the plan table's (tests and benchmarks).
    kv_tokens: a hybrid's KV cache, tokens of keys and values of every attention sublayer at
    most (None: a pool that grows as asked). A request is admitted when its prompt and
    max_tokens fit among the free blocks, which it holds until it ends: it never runs out.
    tokenizer: the checkpoint's tokenizer.json, whose vocabulary guided requests' grammars
    are compiled over (None: the checkpoint has none, and guided requests fail).
    """

    def __init__(self, model: Mamba, prefill: Prefill, max_batch: int = 16, prefill_tokens: int = 1024,
                 prefix_cache_bytes: int = 0, threads: int = 1, decode_plan=None, kv_tokens: int | None = None,
                 tokenizer=None):
        self.model, self.prefill = model, prefill
        self.device = self.model.device
        self.max_batch, self.prefill_tokens, self.threads = max_batch, prefill_tokens, threads
        self.gpu = model.ops is not REFERENCE_OPS  # the GPU engine: its samplers, the step ahead
        self.graphs = prefill.graphs  # CUDA graphs (not for hybrids: their attention reserves KV blocks on the host)
        # (the GPU's eager prefill, a hybrid's, on a coarser grid: prefix_cache.EAGER_INTERVAL says why)
        self.cache = PrefixCache(prefix_cache_bytes, EAGER_INTERVAL if self.gpu and not self.graphs else INTERVAL)
        # a step ahead on the GPU (see above); on the CPU only in tests of the bookkeeping
        self.run_ahead = self.gpu
        self.pool = self.model.new_state(max_batch)  # one slot a running request
        if self.pool.kv is not None and kv_tokens is not None:
            c, kv = model.config, self.pool.kv
            # (a table as wide as the longest context a slot may hold: 128k tokens at most)
            self.pool.kv = KVCache(c.n_attention, c.kv_heads, c.attn_head_dim, max_batch, 1 + kv.blocks_for(kv_tokens),
                                   kv.block_size, max_tokens=min(kv_tokens, 1 << 17), dtype=kv.k.dtype,
                                   device=self.device)
        self.slots: list[RunningRequest | None] = [None] * max_batch
        self.slot_params = SlotParams.empty(max_batch, self.model.config.vocab_size, self.device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # each row's next decode input
        self.waiting: deque[RunningRequest] = deque()
        self.requests: dict[int, RunningRequest] = {}  # waiting and running, by rid
        self.inflight: Launch | None = None  # the step launched and not yet read (GPU)
        self.cache_queries = self.cache_hits = 0
        self.guides = Guides(tokenizer, model.config.vocab_size, model.config.eos_token_id)
        self.decode_graphs = self._chunk_pool = None
        self._chunk_graph_sets: dict = {}
        # decode graphs: a pure Mamba model's on the GPU engine; a hybrid's once its KV cache
        # has a fixed size (its tensors never change) and it is not deterministic (its products
        # are cuBLAS's)
        fixed_kv = self.pool.kv is not None and not self.pool.kv.growable
        if self.graphs or (self.gpu and fixed_kv and not prefill.deterministic):
            self.decode_graphs = PoolDecodeGraphs(self.model, self.pool, self.tokens, prefill.deterministic,
                                                  decode_plan)

    # -- the caller's side ------------------------------------------------------------------

    def add(self, request: protocol.Request) -> RunningRequest:
        """Queues a request (its ids and parameters checked where it was made); it is
        admitted at a step."""
        req = RunningRequest(request.rid, request.ids, request.params, request.top_logprobs)
        req.seed = resolve_seed(req.params.seed)
        stops = req.params.stop_token_ids
        req.stops = frozenset(stops if stops is not None else self.model.config.default_stops)
        self.requests[req.rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: int) -> None:
        """Ends a request without another output (its client went away, or a stop string
        ended its text); its slot is freed at the next step."""
        req = self.requests.get(rid)
        if req is not None:
            req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.requests) or self.inflight is not None

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    def stats(self) -> Stats:
        return Stats(self.running, len(self.waiting), self.cache_queries, self.cache_hits)

    def fail_all(self, error: EngineError) -> list[protocol.Output]:
        """Ends every request with `error` (the engine is shutting down)."""
        outs = []
        for req in list(self.requests.values()):
            self._end(req, outs, error=error)
        self._free()
        self.waiting.clear()
        self.inflight = None
        return outs

    # -- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[protocol.Output]:
        """Runs one step; returns the outputs read in it."""
        outs: list[protocol.Output] = []
        self._free()
        launch = Launch()
        with cpu_threads(self.threads, self.device):
            self._admit(launch, outs)
            self._prefill(launch, outs)
            try:
                self._decode(launch, outs)
            except Exception as e:  # a fault of the step itself: fail what runs, keep serving
                for r in self.slots:
                    if r is not None and not r.finished:
                        self._end(r, outs, error=_error_of(e))
                launch = Launch()
            launch.send()
        if self.run_ahead:  # read the step before this one (unless _decode did)
            launch, self.inflight = self.inflight, (launch if launch.rows else None)
        if launch is not None:
            self._read(launch, outs)
        return outs

    def _forget(self, r: RunningRequest) -> None:
        """A request leaves the engine's books (its slot freed, or never given one)."""
        self.requests.pop(r.rid, None)

    def _free(self) -> None:
        for i, r in enumerate(self.slots):
            if r is not None and (r.finished or r.aborted):
                self.slots[i] = None
                self._forget(r)
                if self.pool.kv is not None:  # (its keys and values are in the prefix cache if it keeps them)
                    self.pool.kv.release(i)
        if any(r.aborted for r in self.waiting):
            for r in [r for r in self.waiting if r.aborted]:
                self.waiting.remove(r)
                self._forget(r)

    def _admit(self, launch: Launch, outs: list) -> None:
        while self.waiting and None in self.slots:
            r = self.waiting.popleft()
            if not self._kv_room(r, outs):
                if not r.finished:  # (it waits for blocks to come free)
                    self.waiting.appendleft(r)
                    break
                continue
            # new requests take the highest free slot: the decoding ones gather at the lowest,
            # so the padding rows of a decode bucket are rarely anyone's
            r.slot = max(k for k, s in enumerate(self.slots) if s is None)
            self.slots[r.slot] = r
            r.queued_s = time.perf_counter() - r.arrived
            try:
                if r.params.guide is not None:
                    r.matcher = self.guides.matcher(r.params.guide, r.stops)
                self.slot_params.set_slot(r.slot, r.params, r.seed, to_device(r.ids, self.device))
                self.pool.reset(r.slot)
                self.cache_queries += 1
                n, hit = self.cache.lookup(r.ids)
                if hit is not None:
                    self.cache_hits += 1
                    self.pool.conv[:, r.slot : r.slot + 1].copy_(hit.conv)
                    self.pool.ssm[:, r.slot : r.slot + 1].copy_(hit.ssm)
                    if hit.kv is not None:
                        self.pool.kv.copy_slot(r.slot, hit.kv, 0)
                    r.pos = r.fed = r.cached_tokens = n
                if self.pool.kv is not None and not self.pool.kv.growable:
                    self.pool.kv.reserve(r.slot, self._kv_tokens(r))  # (its whole context's blocks, from now)
                if n == len(r.ids):  # the whole prompt was cached: its first token from the cached logits
                    self._sample([r], hit.logits[None], launch, checked=False)
            except Exception as e:
                self._end(r, outs, error=_error_of(e))

    def _kv_tokens(self, r: RunningRequest) -> int:
        """The tokens of keys and values a request holds from admission: its prompt and output."""
        return len(r.ids) + r.params.max_tokens

    def _kv_room(self, r: RunningRequest, outs: list) -> bool:
        """Whether a fixed KV cache has the free blocks a request needs; a request that can
        never fit ends with an error saying why."""
        kv = self.pool.kv
        if kv is None or kv.growable:
            return True
        need = kv.blocks_for(self._kv_tokens(r))
        if need > kv.request_blocks:
            self._end(r, outs, error=EngineError(protocol.CONTEXT_TOO_LONG, (
                f"the prompt's {len(r.ids)} tokens and max_tokens {r.params.max_tokens} need {need * kv.block_size} "
                f"tokens of keys and values; this engine's KV cache holds "
                f"{kv.request_blocks * kv.block_size} a request")))
            return False
        return need <= len(kv.free)

    def _prefill(self, launch: Launch, outs: list) -> None:
        budget = self.prefill_tokens
        todo = sorted((r for r in self.slots if r is not None and not r.finished and r.pos < len(r.ids)),
                      key=lambda r: r.arrived)  # oldest first: the earliest request's first token comes first
        # New prompts that fit the budget whole: one batched pass. (With the cache on, one
        # longer than its interval runs in chunks on the grid instead, leaving states along the way.)
        longest = self.cache.interval if self.cache.budget else budget
        fresh = []
        for r in todo:
            if r.pos == 0 and len(r.ids) <= min(budget, longest):
                fresh.append(r)
                budget -= len(r.ids)
        if fresh:
            try:
                self._prefill_fresh(fresh, launch)
            except Exception as e:
                for r in fresh:
                    self._end(r, outs, error=_error_of(e))
        # The rest in rounds of one chunk a request, as far as the budget goes; a round's
        # chunks of one length run together.
        todo = [r for r in todo if r not in fresh]
        while budget > 0 and todo:
            chunks: dict[int, list[RunningRequest]] = {}
            for r in todo:
                if budget <= 0:
                    break
                # chunks end on the cache's interval grid, so that a long prompt leaves
                # states along the way
                grid = (r.pos // self.cache.interval + 1) * self.cache.interval if self.cache.budget else len(r.ids)
                n = min(len(r.ids), r.pos + budget, grid) - r.pos
                chunks.setdefault(n, []).append(r)
                budget -= n
            for n, reqs in chunks.items():
                try:
                    self._prefill_chunks(reqs, n, launch)
                except Exception as e:
                    for r in reqs:
                        self._end(r, outs, error=_error_of(e))
            todo = [r for r in todo if not r.finished and r.pos < len(r.ids)]

    def _prefill_fresh(self, reqs: list[RunningRequest], launch: Launch) -> None:
        """Whole prompts from a zero state, together: left-padded to the longest, through the
        engine's Prefill (prefill.py: CUDA graphs for short ones; each alone in deterministic
        mode). With the cache on (serving), in groups of the chunk graphs' batch sizes,
        whose prefill graphs capture_prefill_graphs captured at start."""
        if self.graphs and self.cache.budget and len(reqs) not in CHUNK_BATCHES:
            b = next(k for k in CHUNK_BATCHES if k <= len(reqs))
            self._prefill_fresh(reqs[:b], launch)
            return self._prefill_fresh(reqs[b:], launch)
        logits, state = self.prefill([r.ids for r in reqs])  # (n, V), state (L, n, ...)
        rows = to_device([r.slot for r in reqs], self.device)
        self.pool.conv.index_copy_(1, rows, state.conv)
        self.pool.ssm.index_copy_(1, rows, state.ssm)
        for k, r in enumerate(reqs):
            if state.kv is not None:  # a hybrid's keys and values into its slot
                self.pool.kv.copy_slot(r.slot, state.kv, k)
            r.pos = r.fed = len(r.ids)
            self.cache.store(r.ids, self._slot_state(r.slot), logits[k])
        self._sample(reqs, logits, launch, checked=True)

    def _prefill_chunks(self, reqs: list[RunningRequest], n: int, launch: Launch) -> None:
        """The next n prompt tokens of each request, continuing its slot's state: through the
        chunk graphs in groups of their batch sizes on the GPU (n up to the cache's
        interval), else one eager pass over the gathered states."""
        graphs = self.graphs and n <= self.cache.interval
        at = 0
        while at < len(reqs):
            b = next(k for k in CHUNK_BATCHES if k <= len(reqs) - at) if graphs else len(reqs) - at
            group = reqs[at : at + b]
            at += b
            ids = to_device([t for r in group for t in r.ids[r.pos : r.pos + n]], self.device).view(b, n)
            rows = to_device([r.slot for r in group], self.device)
            if graphs:
                logits = self._chunk_graphs(b)(ids, self.pool, rows)
            else:
                state = MambaState(self.pool.conv.index_select(1, rows), self.pool.ssm.index_select(1, rows),
                                   self.pool.kv, [r.slot for r in group])
                logits = self.model.prefill(ids, state, last_only=True)
                self.pool.conv.index_copy_(1, rows, state.conv)
                self.pool.ssm.index_copy_(1, rows, state.ssm)
            done = []
            for k, r in enumerate(group):
                r.pos = r.fed = r.pos + n
                if r.pos == len(r.ids) or r.pos % self.cache.interval == 0:
                    self.cache.store(r.ids[: r.pos], self._slot_state(r.slot), logits[k])
                if r.pos == len(r.ids):
                    done.append(k)
            if done:
                self._sample([group[k] for k in done], logits[to_device(done, self.device)], launch, checked=True)

    def _chunk_graphs(self, batch: int):
        """The chunk prefill graphs of one batch size, captured at first use (serve captures
        them at start: capture_prefill_graphs)."""
        graphs = self._chunk_graph_sets.get(batch)
        if graphs is None:
            if self._chunk_pool is None:
                self._chunk_pool = torch.cuda.graph_pool_handle()  # one replays at a time: they share scratch
            graphs = self._chunk_graph_sets[batch] = ChunkPrefillGraphs(self.model, self.cache.interval, batch,
                                                                        self._chunk_pool)
        return graphs

    @torch.inference_mode()
    def capture_prefill_graphs(self) -> None:
        """Captures the prefill graphs a server's steps use, now, so that no request waits
        for a capture (one takes about three prefills' time): the chunk graphs, and the
        graphs of new prompts up to the cache's interval in groups of CHUNK_BATCHES. A GPU
        engine without prefill graphs (a hybrid's) compiles its prefill kernels instead
        (warm_up.warm_up_prefill); a GPU engine compiles its samplers' too (warm_up_samplers)."""
        if self.gpu:
            warm_up.warm_up_samplers(self)
        if not self.graphs:
            if self.gpu:
                warm_up.warm_up_prefill(self)
            return
        for b in CHUNK_BATCHES:
            self._chunk_graphs(b)
            for n in (n for n in PREFILL_BUCKETS if n <= self.cache.interval):
                if not self.prefill.deterministic or b == 1:  # (deterministic: each prompt prefills alone)
                    self.prefill([[0] * n] * b)


    def _sample(self, reqs: list[RunningRequest], logits: torch.Tensor, launch: Launch, checked: bool) -> None:
        """The first tokens of requests whose prompts are in their slots, from logits (n, V):
        sampled with their slots' parameters (gathered, sampled, scattered back) into the
        slots' decode inputs."""
        sampler = pick_sampler([r.params for r in reqs], self.gpu, SAMPLER_TILES)
        slots = to_device([r.slot for r in reqs], self.device)
        params = SlotParams(**{f.name: getattr(self.slot_params, f.name)[slots] for f in fields(self.slot_params)})
        bitmask = token_bitmask([r.matcher for r in reqs], logits)
        tok = sampler(logits, params, bitmask=bitmask)
        for f in fields(self.slot_params):
            getattr(self.slot_params, f.name)[slots] = getattr(params, f.name)
        self.tokens[slots] = tok
        finite = torch.isfinite(logits).all(-1) if checked else None
        k = max((r.top_logprobs or 0 for r in reqs), default=0)
        lp = logprobs_of(masked(logits, bitmask), tok, k) if any(r.top_logprobs is not None for r in reqs) else None
        launch.add(reqs, tok, finite, lp)
        kept = logits.clone() if self.gpu else logits  # (a prefill graph's logits are rewritten by its next replay)
        for n, r in enumerate(reqs):
            r.on_device = r.just_sampled = True
            r.last_logits = (kept, n)

    def _slot_state(self, i: int) -> MambaState:
        return MambaState(self.pool.conv[:, i : i + 1], self.pool.ssm[:, i : i + 1], self.pool.kv, [i])

    def _decoding(self, r: RunningRequest | None) -> bool:
        return r is not None and r.on_device and not r.just_sampled and not r.finished and not r.aborted

    def _move(self, src: int, dst: int) -> None:
        """Swaps two slots: their requests, state rows, sampling rows and decode inputs."""
        a, b = self.slots[src], self.slots[dst]
        for t in (self.pool.conv, self.pool.ssm):
            _swap(t[:, src], t[:, dst])
        if self.pool.kv is not None:
            self.pool.kv.swap(src, dst)
        for f in fields(self.slot_params):
            t = getattr(self.slot_params, f.name)
            _swap(t[src], t[dst])
        _swap(self.tokens[src], self.tokens[dst])
        self.slots[src], self.slots[dst] = b, a
        for r, i in ((a, dst), (b, src)):
            if r is not None:
                r.slot = i

    def _decode(self, launch: Launch, outs: list) -> None:
        decoding = [self._decoding(r) for r in self.slots]
        for r in self.slots:  # a first token sampled in this step's prefill is decoded from the next step
            if r is not None:
                r.just_sampled = False
        d = sum(decoding)
        if not d:
            return
        # The decoding requests move to the first slots, so that the step runs on the
        # pool's first d rows in place (views of it: no gather, no scatter).
        holes = [i for i in range(d) if not decoding[i]]
        movers = [i for i in range(d, self.max_batch) if decoding[i]]
        for hole, mover in zip(holes, movers):
            self._move(mover, hole)
        rows = self.slots[:d]
        if self.decode_graphs is None:
            logits = self.model.step(self.tokens[:d], MambaState(self.pool.conv[:, :d], self.pool.ssm[:, :d],
                                                                self.pool.kv))
        else:
            # the rows between d and the bucket are padding: keep aside any that hold a
            # request still prefilling
            bucket = self.decode_graphs.bucket(d)
            kept = [(i, self.pool.conv[:, i].clone(), self.pool.ssm[:, i].clone(), self.tokens[i].clone())
                    for i in range(d, bucket) if self.slots[i] is not None]
            logits = self.decode_graphs(d)
            if self.pool.kv is not None:  # (the graph advanced the lengths on the device alone)
                self.pool.kv.after_graph_step(d, bucket)
            for i, conv, ssm, tok in kept:
                self.pool.conv[:, i].copy_(conv)
                self.pool.ssm[:, i].copy_(ssm)
                self.tokens[i].copy_(tok)
        for k, r in enumerate(rows):
            r.fed += 1
            r.last_logits = (logits, k)
        if self.inflight is not None and any(r.matcher is not None for r in rows):
            # a guided row's mask needs the step before's token: read that step now, while the
            # pass above runs (a request it ends has its matcher dropped: its row is discarded)
            launch_before, self.inflight = self.inflight, None
            self._read(launch_before, outs)
        sampler = pick_sampler([r.params for r in rows], self.gpu, SAMPLER_TILES)
        bitmask = token_bitmask([r.matcher for r in rows], logits[:d])  # (the logits stay unmasked: the cache keeps them)
        tok = sampler(logits[:d], self.slot_params.rows(0, d), bitmask=bitmask)
        self.tokens[:d].copy_(tok)
        lp = None
        if any(r.top_logprobs is not None for r in rows):
            lp = logprobs_of(masked(logits[:d], bitmask), tok, max(r.top_logprobs or 0 for r in rows))
        launch.add(rows, tok, None, lp)

    # -- reading a step's tokens ------------------------------------------------------------

    def _read(self, launch: Launch, outs: list) -> None:
        pairs, entries = launch.read()
        for (r, checked), (token, finite), entry in zip(launch.rows, pairs, entries):
            if r.finished or r.aborted:
                continue  # a step past its end: discarded
            if checked and not finite:
                self._end(r, outs, error=EngineError(protocol.NON_FINITE, self.model.nonfinite_culprit([r.ids])))
                continue
            r.sampled.append(token)
            if token in r.stops:
                self._end(r, outs, "stop")
                continue
            if r.matcher is not None and not r.matcher.accept_token(token):
                self._end(r, outs, error=EngineError(protocol.INTERNAL, f"the grammar refused token {token}"))
                continue
            first = FirstToken(r.cached_tokens, r.queued_s) if len(r.sampled) == 1 else None
            outs.append(Token(r.rid, token, entry, first))
            if r.matcher is not None and r.matcher.is_terminated():  # (a guide's end without stop tokens)
                self._end(r, outs, "stop")
            elif len(r.sampled) >= r.params.max_tokens:
                self._end(r, outs, "length")

    def _end(self, r: RunningRequest, outs: list, reason: str | None = None, error: EngineError | None = None) -> None:
        if r.finished:
            return
        r.finished = True
        r.matcher = None
        if r.slot is None:  # still waiting
            self._forget(r)
        if error is not None:
            outs.append(Failed(r.rid, error))
            return
        if r.slot is not None and r.last_logits is not None and not r.aborted:
            # the state after the prompt and every token fed since: a chat's next turn resumes here
            logits, row = r.last_logits
            fed = (r.ids + r.sampled)[: r.fed]
            self.cache.store(fed, self._slot_state(r.slot), logits[row])
        outs.append(Finished(r.rid, reason, len(r.ids), len(r.output), r.cached_tokens, r.queued_s))


def _error_of(e: Exception) -> EngineError:
    """An exception of a step's work as the error its requests end with."""
    if isinstance(e, NonFiniteError):  # the model's output overflowed for this input
        return EngineError(protocol.NON_FINITE, str(e))
    if isinstance(e, GuideError):  # a guide that cannot be served: the request's fault
        return EngineError(protocol.BAD_REQUEST, str(e), e.field)
    return EngineError(protocol.INTERNAL, f"{type(e).__name__}: {e}")


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    row = a.clone()
    a.copy_(b)
    b.copy_(row)

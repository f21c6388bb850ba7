"""LanguageModel, the object `fastmamba.load` returns: forward, generate, stream, generate_batch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from fastmamba.engine.cuda_graphs import PREFILL_BUCKETS, GraphPrefill, graph_prefill_tokens
from fastmamba.core.model import Mamba
from fastmamba.core.state import MambaState
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.io.prompts import PromptEncoder, check_token_ids, describe, is_integer_dtype
from fastmamba.io.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only; a stop token is not included
    text: str | None  # None when the checkpoint has no tokenizer
    finish_reason: str  # "stop" (a stop token came) or "length" (max_tokens reached)
    prompt_tokens: int


@dataclass
class StreamPiece:
    token_id: int | None  # None only for a last piece that flushes held-back text
    text: str | None


class LanguageModel:
    def __init__(
        self,
        model: Mamba,
        tokenizer: Tokenizer | None,
        path: Path | None = None,
        engine: str = "reference",
        deterministic: bool = False,
        threads: int | None = None,
    ):
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.path = path
        self.engine = engine  # "reference" (pure PyTorch) or "triton" (GPU kernels + CUDA graphs)
        self.deterministic = deterministic
        # PyTorch's CPU threads while this model computes (restored between calls and
        # between streamed tokens): per-token products are small, and a second thread that
        # waits for a core held by another process stalls every one of them (bundled model:
        # 105 tokens/s with one thread beside a busy process, 28 with two). 0: as PyTorch has it.
        self.threads = 1 if threads is None else threads
        self._graph_prefills: dict[tuple[int, int], GraphPrefill] = {}
        self._prefill_pool = None  # the prefill graphs' one memory pool (see GraphPrefill)
        self._backbone = None
        self._core = None  # the engine (engine.py) under generate, stream and generate_batch
        self._pending: dict[int, list] = {}  # outputs read for a generation that another one's loop drove

    def _engine(self, batch: int):
        """The engine core, with at least `batch` slots (made anew, larger, when a batch
        outgrows it: its decode graphs are captured for every bucket up to its size)."""
        from fastmamba.engine.engine_core import EngineCore

        if self._core is None or self._core.max_batch < batch:
            if self._core is not None and any(not (r.finished or r.aborted) for r in self._core.requests.values()):
                raise RuntimeError("a generation is still running: finish it before starting a larger batch")
            slots = 1 << (batch - 1).bit_length()  # powers of two: few rebuilds
            # offline, a step prefills whole prompts up to the model's chunk (no grid: no cache)
            self._core = EngineCore(self, max_batch=slots, prefill_tokens=self.model.chunk_tokens)
        return self._core

    def _prefill(self, padded: torch.Tensor, start: torch.Tensor):
        """Logits of each row's last token (B, V) and the state after the prompts."""
        B, T = padded.shape
        bucket = next((n for n in PREFILL_BUCKETS if n >= T), None)
        if self.engine == "reference" or bucket is None or B * bucket > graph_prefill_tokens(self.config.d_model):
            state = self.model.new_state(B)
            return self.model.prefill(padded, state, start, last_only=True), state
        graph = self._graph_prefills.get((B, bucket))
        if graph is None:  # captured once per batch size and bucket, then reused
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = self._graph_prefills[(B, bucket)] = GraphPrefill(self.model, B, bucket, self._prefill_pool)
        return graph(padded, start)

    def _prefill_prompts(self, all_ids: list[list[int]]) -> tuple[torch.Tensor, MambaState]:
        """Each prompt's last-token logits (B, V) and the state after it. The prompts
        prefill together, left-padded to the longest (padding leaves a row's state
        untouched). With `deterministic`, each prefills alone, as `generate` would prefill it
        (so its logits are bitwise the same in any batch): a batched prefill's products and
        scan chunks follow the batch's shape, and with them a row's rounding."""
        if self.deterministic and len(all_ids) > 1:
            logits, conv, ssm = [], [], []
            for ids in all_ids:  # (copies: a prefill graph's outputs are its own, rewritten next call)
                one, state = self._prefill_prompts([ids])
                logits.append(one.clone())
                conv.append(state.conv.clone())
                ssm.append(state.ssm.clone())
            return torch.cat(logits), MambaState(torch.cat(conv, 1), torch.cat(ssm, 1))
        longest = max(len(ids) for ids in all_ids)
        padded = np.zeros((len(all_ids), longest), dtype=np.int64)  # (numpy fills rows from lists at C speed)
        for row, ids in zip(padded, all_ids):
            row[longest - len(ids):] = ids
        padded = torch.from_numpy(padded)
        start = torch.tensor([longest - len(ids) for ids in all_ids], dtype=torch.int32)
        if self.device.type == "cuda":  # (from pinned memory: a plain copy would wait for the GPU's queued work)
            padded, start = (t.pin_memory().to(self.device, non_blocking=True) for t in (padded, start))
        return self._prefill(padded, start)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def backbone(self):
        """The model's layers and final norm as a fastmamba.Backbone (vectors of d_model in
        and out) over the model's own tensors, shared, not copied."""
        if self._backbone is None:
            from fastmamba.engine.backbone import Backbone

            self._backbone = Backbone.of_language_model(self.model)
        return self._backbone

    @property
    def dtype(self) -> torch.dtype:
        return self.model.weights.embedding.dtype

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LanguageModel({self.path}, d_model={c.d_model}, n_layer={c.n_layer}, vocab={c.vocab_size}, "
            f"device={self.device}, dtype={self.dtype})"
        )

    # -- plain forward ---------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, T, V) of whole sequences (V may include padding columns).

        input_ids: an integer tensor (B, T) with B, T >= 1; anything else is a ValueError."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not is_integer_dtype(input_ids.dtype):
            raise ValueError("input_ids must be an integer tensor of shape (batch, time)")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: give at least one row of one token")
        self._check_ids(input_ids.flatten().tolist(), "input_ids")
        with self._threads():
            logits = self.model.forward(input_ids.to(self.device, torch.int64))
            self.model.check_finite(logits, input_ids)  # (its rows are read only if the logits are not finite)
            return logits

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompt, params: SamplingParams | None = None, **sampling) -> Generation:
        """Continues `prompt` and returns a Generation (the new tokens, their text, why it
        stopped, the prompt's length).

        prompt: a str (the checkpoint needs a tokenizer) or token ids (see `encode`).
        params: a SamplingParams or a dict of its fields; keyword arguments override fields.
        A given seed gives the same tokens every time, alone or beside other prompts.
        Raises ValueError naming a bad prompt or value, TypeError for an unknown option."""
        params = SamplingParams.from_kwargs(params, sampling)
        return self.generate_batch([prompt], params)[0]

    def stream(self, prompt, params: SamplingParams | None = None, **sampling) -> Iterator[StreamPiece]:
        """Like `generate`, but yields a StreamPiece per token as soon as it is sampled: its
        id and the text it completes (pieces never split a UTF-8 character; a last piece
        with no token may carry held-back text). The texts concatenate to `generate`'s."""
        params = SamplingParams.from_kwargs(params, sampling)
        ids = self.encode(prompt)
        self._check_ids(params.stop_token_ids or [], "SamplingParams.stop_token_ids")
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer else None
        for _, token, _ in self._generate([ids], [params]):
            if token is not None:
                yield StreamPiece(token, decoder.push(token) if decoder else None)
        if decoder and (tail := decoder.flush()):
            yield StreamPiece(None, tail)

    def generate_batch(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Generation]:
        """Generates for several prompts together, one Generation each, in order; each is
        what `generate` gives that prompt alone (same seed, same tokens).

        params: one SamplingParams (or dict) for all, or a list with one per prompt.
        Raises ValueError naming the bad prompt, parameter or stop token id."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of prompts, got {describe(prompts)}")
        if params is None or isinstance(params, (SamplingParams, dict)):
            params = [SamplingParams.from_kwargs(params, {})] * len(prompts)
        elif isinstance(params, (list, tuple)) and len(params) == len(prompts):
            params = [SamplingParams.from_kwargs(p, {}) if isinstance(p, dict) else p for p in params]
        if not isinstance(params, list) or len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be one SamplingParams (or dict) or a list of {len(prompts)} of them")
        for p in params:
            self._check_ids(p.stop_token_ids or [], "SamplingParams.stop_token_ids")
        all_ids = [self.encode(p) for p in prompts]
        decoders = [IncrementalDecoder(self.tokenizer) if self.tokenizer else None for _ in prompts]
        texts = [[] for _ in prompts]
        out = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for i, token, reason in self._generate(all_ids, params):
            if token is not None:
                out[i].append(token)
                if decoders[i]:
                    texts[i].append(decoders[i].push(token))
            if reason:
                finish[i] = reason
        return [
            Generation(
                token_ids=out[i],
                text="".join(texts[i]) + decoders[i].flush() if decoders[i] else None,
                finish_reason=finish[i],
                prompt_tokens=len(all_ids[i]),
            )
            for i in range(len(prompts))
        ]

    # -- internals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _threads(self):
        """PyTorch's CPU thread count set to `self.threads` for the work inside."""
        before = torch.get_num_threads()
        if self.threads and self.device.type == "cpu" and before != self.threads:
            torch.set_num_threads(self.threads)
            try:
                yield
            finally:
                torch.set_num_threads(before)
        else:
            yield

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a str, or token ids (a list or tuple of ints, a 1-D integer
        tensor or numpy array). Anything else is a ValueError naming the problem."""
        return PromptEncoder(self.tokenizer, self.config.vocab_size, self.path).encode(prompt)

    def _check_ids(self, ids, what: str) -> list[int]:
        return check_token_ids(ids, self.config.vocab_size, what)

    def _generate(self, all_ids: list[list[int]], params: list[SamplingParams]):
        """Yields (prompt index, token or None, finish reason or None) as the engine makes
        them: the prompts run as requests of the engine core, driven from here. Another
        generation's outputs read meanwhile (an interleaved stream) wait for its own loop."""
        from fastmamba.engine.engine_core import EngineRequest
        from fastmamba.core.errors import NonFiniteError

        core = self._engine(len(all_ids))
        reqs = [core.add(EngineRequest(ids, p)) for ids, p in zip(all_ids, params)]
        index = {r.rid: i for i, r in enumerate(reqs)}
        for r in reqs:
            self._pending[r.rid] = []
        left = len(reqs)
        try:
            while left:
                mine = [o for r in reqs for o in self._pending[r.rid]]
                for r in reqs:
                    self._pending[r.rid].clear()
                if not mine:
                    for o in core.step():
                        if o[0] in self._pending:
                            self._pending[o[0]].append(o)
                    continue
                for rid, token, _, reason, info in mine:
                    if reason == "error":
                        message = info["message"]
                        if message.startswith("NonFiniteError: "):
                            raise NonFiniteError(message.removeprefix("NonFiniteError: "))
                        raise RuntimeError(f"generation failed: {message}")
                    left -= reason is not None
                    yield index[rid], token, reason
        finally:  # also when the caller stops reading a stream: its requests end
            for r in reqs:
                core.abort(r.rid)
                self._pending.pop(r.rid, None)

"""LanguageModel, the object `fastmamba.load` returns: forward, generate, stream, generate_batch."""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .cuda_graphs import PREFILL_BUCKETS, GraphDecoder, GraphPrefill, HostTokens, ReferenceDecoder, graph_prefill_tokens
from .model import Mamba, MambaState
from .sampling import SamplingParams, pick_sampler, resolve_seed
from .tokenizer import IncrementalDecoder, Tokenizer


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
        self._graph_decoders: dict[int, GraphDecoder] = {}
        self._graph_prefills: dict[tuple[int, int], GraphPrefill] = {}
        self._prefill_pool = None  # the prefill graphs' one memory pool (see GraphPrefill)
        self._backbone = None

    def _decoder(self, batch: int):
        if self.engine == "reference":
            return ReferenceDecoder(self.model, batch)
        cached = self._graph_decoders.get(batch)
        if cached is None:  # captured once per batch size, then reused
            cached = self._graph_decoders[batch] = GraphDecoder(self.model, batch, self.deterministic)
        # A decoder holds one generation's state: a generation that runs while another is
        # still going (two interleaved streams) gets a decoder of its own.
        return cached if not cached.busy else GraphDecoder(self.model, batch, self.deterministic)

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
        padded = torch.from_numpy(padded).to(self.device)
        start = torch.tensor([longest - len(ids) for ids in all_ids], device=self.device, dtype=torch.int32)
        logits, state = self._prefill(padded, start)
        self.model.check_finite(logits, all_ids)
        return logits, state

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def backbone(self):
        """The model's layers and final norm as a fastmamba.Backbone (vectors of d_model in
        and out) over the model's own tensors, shared, not copied."""
        if self._backbone is None:
            from .backbone import Backbone

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
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not _is_integer(input_ids.dtype):
            raise ValueError("input_ids must be an integer tensor of shape (batch, time)")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: give at least one row of one token")
        self._check_ids(input_ids.flatten().tolist(), "input_ids")
        with self._threads():
            logits = self.model.forward(input_ids.to(self.device, torch.int64))
            self.model.check_finite(logits, input_ids.tolist())
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
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer else None
        for tokens, _ in self._decode([ids], [params]):
            if tokens[0] is not None:
                yield StreamPiece(tokens[0], decoder.push(tokens[0]) if decoder else None)
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
            raise ValueError(f"prompts must be a non-empty list of prompts, got {_describe(prompts)}")
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
        for tokens, reasons in self._decode(all_ids, params):
            for i, t in enumerate(tokens):
                if t is not None:
                    out[i].append(t)
                    if decoders[i]:
                        texts[i].append(decoders[i].push(t))
                if reasons[i]:
                    finish[i] = reasons[i]
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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                where = f" in {self.path}" if self.path else ""
                raise ValueError(f"this model has no tokenizer.json{where}: pass the prompt as a list of token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid text: a lone surrogate at character {e.start}") from None
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        elif hasattr(prompt, "dtype") and hasattr(prompt, "tolist"):  # a torch tensor or numpy array
            kind = getattr(prompt, "ndim", None)
            if kind != 1 or not _is_integer(prompt.dtype):
                raise ValueError(f"a prompt of token ids must be 1-D integers, got {_describe(prompt)}")
            ids = prompt.tolist()
        else:
            hint = " (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else ""
            raise ValueError(f"a prompt is a str or a list of token ids, got {_describe(prompt)}{hint}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return self._check_ids(ids, "prompt")

    def _check_ids(self, ids, what: str) -> list[int]:
        return check_token_ids(ids, self.config.vocab_size, what)

    @torch.inference_mode()
    def _decode(self, all_ids: list[list[int]], params: list[SamplingParams]):
        """Yields, per step, each slot's new token (None once finished) and finish reason.

        The prompts are prefilled (_prefill_prompts), then all slots decode together; a
        finished slot keeps its place in the batch but yields nothing more.
        """
        B = len(all_ids)
        with self._threads():
            logits, state = self._prefill_prompts(all_ids)  # (B, V)

        decoder = self._decoder(B)
        requests = [(p, resolve_seed(p.seed), ids) for ids, p in zip(all_ids, params)]
        stops = [set(p.stop_token_ids) if p.stop_token_ids is not None else {self.config.eos_token_id} for p in params]
        remaining = [p.max_tokens for p in params]
        decoder.busy = True
        try:
            with self._threads():
                first = decoder.begin(state, logits, pick_sampler(params, self.engine == "triton"), requests)
                block = HostTokens(first[None])  # (steps, B) ids, the only device -> host traffic
            while True:
                # The next block of steps goes into the queue before this one is read, where
                # a slot needs tokens past it (unless a stop token comes first).
                if decoder.runs_ahead and max(remaining) > len(block.host):
                    with self._threads():
                        ahead = HostTokens(decoder.next())
                else:
                    ahead = None
                for host in block.tolist():
                    out, reasons = [None] * B, [None] * B
                    for i, t in enumerate(host):
                        if remaining[i] == 0:
                            continue
                        if t in stops[i]:
                            remaining[i], reasons[i] = 0, "stop"
                            continue
                        out[i] = t
                        remaining[i] -= 1
                        if remaining[i] == 0:
                            reasons[i] = "length"
                    yield out, reasons
                    if not any(remaining):
                        return
                if ahead is None:
                    with self._threads():
                        ahead = HostTokens(decoder.next())
                block = ahead
        finally:
            decoder.busy = False


def check_token_ids(ids, vocab: int, what: str) -> list[int]:
    """ids as a list of Python ints, or a ValueError naming the first one that is not a
    token id in [0, vocab). (The server checks request fields with it too.)"""
    if isinstance(ids, list) and set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids  # (C-level checks: a long prompt's ids one by one in Python cost milliseconds)
    for t in ids:  # the first culprit, named
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{what} holds {t!r} ({type(t).__name__}), not an integer token id")
        if not 0 <= t < vocab:
            raise ValueError(f"{what} holds token id {int(t)}, outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]


def _is_integer(dtype) -> bool:
    """True for the integer dtypes of torch and numpy (not bool, float or complex)."""
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return getattr(dtype, "kind", None) in ("i", "u")


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:120]

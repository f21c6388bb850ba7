"""A request as the engine runs it (`RunningRequest`: its slot, what its state has taken in,
what it sampled), and one step's sampled tokens on their way to the host (`Launch`: copied
behind the step's work, read when the host needs them; engine_core.py's step ahead)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.protocol import Logprob


@dataclass(eq=False)
class RunningRequest:
    """A request (protocol.Request) as the engine runs it."""

    rid: int
    ids: list[int]
    params: SamplingParams  # max_tokens is the request's own bound
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k best
    arrived: float = field(default_factory=time.perf_counter)
    seed: int = 0
    stops: frozenset = frozenset()
    slot: int | None = None
    pos: int = 0  # prompt tokens in the slot's state (cached or prefilled)
    fed: int = 0  # tokens the slot's state has taken in: the prompt's, then each decode input
    sampled: list[int] = field(default_factory=list)  # every token sampled, a stop token included
    cached_tokens: int = 0
    on_device: bool = False  # its last sampled token waits on the device as the next decode input
    just_sampled: bool = False  # its first token came in this step's prefill: it decodes from the next
    finished: bool = False
    aborted: bool = False
    queued_s: float = 0.0
    last_logits: tuple | None = None  # (logits, row): the logits after the last token fed
    matcher: object | None = None  # a guided request's grammar matcher (guides.py), from its admission

    @property
    def output(self) -> list[int]:
        return self.sampled[:-1] if self.sampled and self.sampled[-1] in self.stops else self.sampled


class Launch:
    """One step's sampled tokens (and logprobs) on their way to the host: copied into pinned
    memory behind the step's work, with one event, so the host reads them when it needs them
    and not sooner."""

    def __init__(self):
        self.rows: list[tuple[RunningRequest, bool]] = []  # (request, finite-checked) per token
        self.parts: list[torch.Tensor] = []  # device int64: each part's tokens, then its finite flags
        self.logprobs: list[tuple[int, tuple]] = []  # (first row, (chosen, top ids, top values))
        self.host = None

    def add(self, reqs: list[RunningRequest], tokens: torch.Tensor, finite: torch.Tensor | None = None,
            logprobs: tuple | None = None) -> None:
        if logprobs is not None:
            self.logprobs.append((len(self.rows), logprobs))
        self.rows += [(r, finite is not None) for r in reqs]
        tokens = tokens.long()
        flags = torch.ones_like(tokens) if finite is None else finite.to(torch.int64).expand(tokens.shape)
        self.parts.append(torch.stack([tokens, flags], 1))

    def send(self) -> None:
        if not self.parts:
            return
        tensors = [torch.cat(self.parts)] + [t for _, lp in self.logprobs for t in lp]
        if tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = tensors, None

    def read(self):
        """(token, finite) per row, and each row's logprob entry or None."""
        if self.host is None:
            return [], []
        if self.done is not None:
            self.done.synchronize()
        pairs = self.host[0].tolist()
        entries = [None] * len(self.rows)
        at = 1
        for first, _ in self.logprobs:
            chosen, top_ids, top_values = (self.host[at + k].tolist() for k in range(3))
            at += 3
            for k, c in enumerate(chosen):
                entries[first + k] = Logprob(c, list(zip(top_ids[k], top_values[k])))
        return pairs, entries


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple:
    """The chosen tokens' log-probabilities (n,) and the k best (n, k) ids and values, on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, k, dim=-1)
    return lp.gather(1, tokens[:, None])[:, 0], top.indices, top.values

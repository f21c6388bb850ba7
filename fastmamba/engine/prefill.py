"""Prefill of new prompts from a zero state: left-padded together in one pass (padding
leaves a row's state untouched), eagerly or, on the GPU engine, as a CUDA graph per batch
size and padded length where issuing the eager launches would outlast the GPU's work
(cuda_graphs.graph_prefill_tokens)."""

from __future__ import annotations

import numpy as np
import torch

from fastmamba.core.model import Mamba
from fastmamba.core.state import MambaState
from fastmamba.core.transfer import to_device
from fastmamba.engine.cuda_graphs import (
    PREFILL_BUCKETS,
    GraphPrefill,
    graph_prefill_tokens,
)


class Prefill:
    """`prefill(prompts) -> (logits (B, V), state)`: each prompt's last-token logits and the
    state after it, for prompts given as token id lists.

    graphs: replay CUDA graphs for short prompts (the GPU engine); deterministic: each
    prompt prefills alone, as `generate` would prefill it, so that its logits are bitwise the
    same in any batch (a batched prefill's products and scan chunks follow the batch's
    shape, and with them a row's rounding)."""

    def __init__(self, model: Mamba, graphs: bool = False, deterministic: bool = False):
        self.model, self.graphs, self.deterministic = model, graphs, deterministic
        self._graphs: dict[tuple[int, int], GraphPrefill] = {}
        self._pool = None  # the prefill graphs' one memory pool (see GraphPrefill)

    def __call__(self, all_ids: list[list[int]]) -> tuple[torch.Tensor, MambaState]:
        if self.deterministic and len(all_ids) > 1:
            logits, conv, ssm, kvs = [], [], [], []
            for ids in all_ids:  # (copies: a prefill graph's outputs are its own, rewritten next call)
                one, state = self([ids])
                logits.append(one.clone())
                conv.append(state.conv.clone())
                ssm.append(state.ssm.clone())
                kvs.append(state.kv)
            kv = None
            if kvs[0] is not None:  # a hybrid's keys and values: each prompt's into its row of one cache
                kv = self.model.new_state(len(all_ids), max(len(ids) for ids in all_ids)).kv
                for k, one_kv in enumerate(kvs):
                    kv.copy_slot(k, one_kv, 0)
            return torch.cat(logits), MambaState(torch.cat(conv, 1), torch.cat(ssm, 1), kv)
        longest = max(len(ids) for ids in all_ids)
        padded = np.zeros((len(all_ids), longest), dtype=np.int64)  # (numpy fills rows from lists at C speed)
        for row, ids in zip(padded, all_ids):
            row[longest - len(ids):] = ids
        padded = torch.from_numpy(padded)
        start = torch.tensor([longest - len(ids) for ids in all_ids], dtype=torch.int32)
        device = self.model.device
        return self.padded(to_device(padded, device), to_device(start, device))

    def padded(self, padded: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, MambaState]:
        """The same for prompts already left-padded: padded (B, T) on the model's device,
        row b's prompt starting at start[b]."""
        B, T = padded.shape
        bucket = next((n for n in PREFILL_BUCKETS if n >= T), None)
        if not self.graphs or bucket is None or B * bucket > graph_prefill_tokens(self.model.config.d_model):
            state = self.model.new_state(B)
            return self.model.prefill(padded, state, start, last_only=True), state
        graph = self._graphs.get((B, bucket))
        if graph is None:  # captured once per batch size and bucket, then reused
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = self._graphs[(B, bucket)] = GraphPrefill(self.model, B, bucket, self._pool)
        return graph(padded, start)

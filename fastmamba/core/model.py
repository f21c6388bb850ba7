"""The Mamba language model in pure PyTorch over `Ops`: embedding, sublayers of the layer
table's kinds (Mamba-1 or Mamba-2 mixers; in a hybrid also attention, MLPs, or Falcon-H1's
Mamba-2 + attention), final norm and LM head. On the reference ops it is the CPU
engine and the oracle for the GPU kernels; on the Triton ops, the GPU engine's prefill.

One definition for every storage dtype: the large matrices stay in their storage dtype and
are upcast per product, so every product accumulates in float32 (docs/architecture.md), as do
the residual stream, the conv and ssm states, and the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core.config import MambaConfig
from fastmamba.core.errors import NonFiniteError
from fastmamba.core.families import sublayers
from fastmamba.core.fp8 import FP8, Fp8Weight, block_scaled
from fastmamba.core.layers import Memory, kinds, layer_kind
from fastmamba.core.ops import REFERENCE_OPS, Ops
from fastmamba.core.state import MambaState
from fastmamba.core.transfer import to_device


@dataclass
class MambaWeights:
    embedding: torch.Tensor  # (V, d) storage dtype (under fp8: dtypes.embedding_dtype's)
    layers: list  # each sublayer's weights (its kind's: mamba1.LayerWeights, mamba2.Mamba2LayerWeights, ...)
    norm_f: torch.Tensor  # (d,) f32
    lm_head: torch.Tensor | Fp8Weight  # (V, d) storage dtype; the embedding itself when tied
    fp8: bool = False  # the projections (and an untied head) are Fp8Weights (core/fp8.py)

    @property
    def dtype(self) -> torch.dtype:
        """The large matrices' storage dtype (float8_e4m3fn for FP8 weights, whose embedding
        keeps its own)."""
        return FP8 if self.fp8 else self.embedding.dtype


class Mamba:
    """A Mamba language model (pure, or a hybrid): embedding, sublayers, final norm and LM head.

    `backbone` is the recurrent core on its own (vectors in, vectors out), for uses
    outside language modelling.
    """

    def __init__(self, config: MambaConfig, weights: MambaWeights, ops: Ops = REFERENCE_OPS, chunk_tokens: int = 16384,
                 state_dtype: torch.dtype = torch.float32):
        if weights.fp8 and not ops.fp8:
            raise ValueError("fp8 weights run on the reference ops or the GPU's (core/ops.triton_ops), not on "
                             "these ops (the training ops take plain tensors)")
        if weights.fp8 and ops is not REFERENCE_OPS:
            blocks = block_scaled(weights)
            if blocks:
                raise ValueError(f"block-scaled FP8 weights ({blocks[0]} and {len(blocks) - 1} more) run on the "
                                 "reference engine (engine='reference'): the GPU's FP8 products take a scale a row")
        self.config = config
        self.weights = weights
        self.ops = ops
        self.layer = layer_kind(config)  # the Mamba sublayers' kind
        self.kinds = kinds(config)
        # each sublayer's Memory indices: its recurrent state's (among the Mamba sublayers) and
        # its KV cache's (among the attention sublayers)
        self.memory_at = []
        r = a = 0
        for kind in self.kinds:
            self.memory_at.append((r if kind.state else None, a if kind.kv else None))
            r, a = r + (kind.state is not None), a + kind.kv
        # The dtype the conv and ssm states are stored in; every update computes in float32
        # and rounds once on store (the reference ops promote a 16-bit state as they read it).
        self.state_dtype = state_dtype
        # Prefill runs long prompts in chunks of at most this many tokens across the batch
        # (chunk_tokens // B steps a row), so activation memory stays bounded whatever the
        # prompt. Large chunks pay: each chunk is one pass of every layer's kernels, and the
        # scan's parallelism over time grows with it (H200, bf16: a 100,000-token prompt on
        # 130m 314 ms in 4096-token chunks, 117 in 16384; 2.8b 1 x 16384 251 -> 239 ms).
        self.chunk_tokens = chunk_tokens

    @property
    def device(self) -> torch.device:
        return self.weights.embedding.device

    def new_state(self, batch: int, tokens: int = 0) -> MambaState:
        """Zero state for `batch` slots; a hybrid's KV cache with room for `tokens` tokens a
        slot to start with (it grows)."""
        return MambaState.zeros(self.config, batch, self.device, self.state_dtype, self.weights.embedding.dtype, tokens)

    def _memory(self, state: MambaState, i: int, rows: torch.Tensor | None, blocks: int) -> Memory:
        r, a = self.memory_at[i]
        m = Memory()
        if r is not None:
            m.conv, m.ssm = state.conv[r], state.ssm[r]
        if a is not None:
            m.kv, m.layer, m.rows, m.blocks = state.kv, a, rows, blocks
        return m

    def backbone(self, h: torch.Tensor, state: MambaState, start=None, check: bool | None = None,
                 counts: list[int] | None = None) -> torch.Tensor:
        """All sublayers and the final norm over T inputs: h (B, T, d) f32 -> (B, T, d) f32.

        check: raise NonFiniteError at the first sublayer whose output holds NaN or inf. Always
        on the reference ops (a reduction a sublayer, small beside its products on the CPU);
        off in the GPU kernels' pass, where the caller checks the logits and, if they are not
        finite, runs `nonfinite_culprit` to name the sublayer.
        counts: a hybrid's real tokens a row (T less its left padding), for its KV cache's
        blocks (read from `start` where not given)."""
        check = self.ops is REFERENCE_OPS if check is None else check
        h, o, eps = h.float(), None, self.config.norm_eps
        operands = self.weights.embedding.dtype  # the dtype the products read (GPU path; the reference keeps f32)
        kv, rows_dev, blocks = state.kv, None, 0
        if kv is not None and not state.kv_host:  # (a CUDA graph's pass: slots 0 .. B-1, device work alone)
            rows_dev = torch.arange(h.shape[0], device=h.device)
        elif kv is not None:
            rows = state.cache_rows()
            if counts is None:
                T = h.shape[1]
                counts = [T - s for s in start.tolist()] if start is not None else [T] * len(rows)
            for r, n in zip(rows, counts):
                kv.reserve(r, kv.held[r] + n)
            blocks = max(kv.blocks_for(kv.held[r] + n) for r, n in zip(rows, counts))
            rows_dev = to_device(rows, h.device)
        for i, (kind, lw) in enumerate(zip(self.kinds, self.weights.layers)):
            h, u = self.ops.add_norm(h, o, lw.norm_w, eps, operands)
            o = kind.run(self.config, lw, u, self._memory(state, i, rows_dev, blocks), self.ops, start)
            if check and not torch.isfinite(o).all():
                raise NonFiniteError(
                    f"the model's output is not finite: layer {i} ({self._name(i)}) gives NaN or inf for this "
                    f"input, its weights overflow the arithmetic (storage {str(self.weights.dtype).removeprefix('torch.')})")
        if kv is not None and not state.kv_host:
            kv.lengths[: h.shape[0]] += h.shape[1]
        elif kv is not None:
            kv.advance(rows, counts)
        return self.ops.add_norm(h, o, self.weights.norm_f, eps, torch.float32)[1]

    def _name(self, i: int) -> str:
        """Sublayer i's place in the checkpoint (its norm's prefix)."""
        if getattr(self.config, "family", "mamba") == "mamba":
            return f"backbone.layers.{i}"
        return sublayers(self.config)[i].norm.rsplit(".", 2)[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of token ids (B, T) -> (B, T, d), scaled by the family's multiplier."""
        h = self.weights.embedding[ids]
        m = getattr(self.config, "embedding_multiplier", 1.0)
        return h if m == 1.0 else h.float() * m

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (f32) of final-normed hidden states, scaled by the family's multiplier."""
        logits = self.ops.linear(h, self.weights.lm_head)
        m = getattr(self.config, "logits_multiplier", 1.0)
        return logits if m == 1.0 else logits * m

    def check_finite(self, logits: torch.Tensor, prompts) -> None:
        """NonFiniteError naming the first layer at fault if `logits` (of the prefill of
        `prompts` from a zero state) hold NaN or inf; one reduction and one read otherwise."""
        if not torch.isfinite(logits).all():
            raise NonFiniteError(self.nonfinite_culprit(prompts))

    def nonfinite_culprit(self, prompts) -> str:
        """Why the prefill of `prompts` (token id lists, or the rows of a (B, T) tensor) is not
        finite: each prompt's prefill again, with a check after every layer, names the first
        layer (or the final norm, or lm_head)."""
        try:
            for ids in prompts:
                x = torch.as_tensor(ids, dtype=torch.int64, device=self.device)[None]
                h = self.backbone(self.embed(x), self.new_state(1, x.shape[1]), check=True)  # raises at a sublayer
                if not torch.isfinite(h).all():
                    return "the model's output is not finite: the final norm (backbone.norm_f) gives NaN or inf for this input"
        except NonFiniteError as e:
            return str(e)
        return "the model's output is not finite: lm_head gives NaN or inf for this input"

    def prefill(
        self, input_ids: torch.Tensor, state: MambaState, start: torch.Tensor | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits for T tokens, continuing from `state` and updating it.

        input_ids (B, T) -> (B, T, V) f32, or (B, V) for the last token alone (last_only).
        start (B,) int32: row b is left-padded up to start[b] (and starts from a zero state).
        Long inputs run in chunks of `self.chunk_tokens` tokens, so memory stays bounded.
        """
        B, T = input_ids.shape
        chunk = max(1, self.chunk_tokens // B)  # steps a row
        # a hybrid's real tokens a row, on the host, for its KV cache's blocks
        start_host = start.tolist() if state.kv is not None and start is not None else [0] * B
        outs = []
        for c0 in range(0, T, chunk):
            ids = input_ids[:, c0 : c0 + chunk]
            chunk_start = None if start is None else (start - c0).clamp(min=0).to(torch.int32)
            counts = [max(0, min(T, c0 + ids.shape[1]) - max(s, c0)) for s in start_host]
            h = self.backbone(self.embed(ids), state, chunk_start, counts=counts)  # (B, Tc, d)
            if last_only:
                h = h[:, -1:] if c0 + chunk >= T else None
            if h is not None:
                outs.append(self.head(h))
        logits = torch.cat(outs, dim=1)
        return logits[:, -1] if last_only else logits

    def step(self, input_ids: torch.Tensor, state: MambaState) -> torch.Tensor:
        """One decode step: input_ids (B,) -> logits (B, V) f32; updates `state`."""
        return self.prefill(input_ids[:, None], state, last_only=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a whole sequence from an empty state: (B, T) -> (B, T, V) f32."""
        return self.prefill(input_ids, self.new_state(input_ids.shape[0], input_ids.shape[1]))

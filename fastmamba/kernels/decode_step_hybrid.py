"""A hybrid's decode step as one-row kernels (the plan's "one-row" step for Nemotron-H, Bamba,
Granite-4.0-H and Falcon-H1): Mamba-2's three kernels a layer (decode_step_mamba2.py), and
the attention and MLP sublayers in the same design, two to five launches each where their
sublayers over the GPU ops take four to six.

Per sublayer, for B slots (rows), with h + dh_in the residual stream as the sublayer's norm
reads it and dh_out its own output's share (fixed point, added by split-K programs):

    mamba2       rmsnorm_linear (in_proj), ssd_conv_step (folds dh_in into h),
                 gated_out_proj (-> dh_out)                                           3 launches
    attention    rmsnorm_linear (q, k and v in one product), paged_attention's three
                 kernels (rotate and store, attend in splits, combine), out_product
                 (o_proj -> dh_out; folds dh_in into h)                              5
    mlp          rmsnorm_linear (gate and up in one product), out_product (the
                 activation taken as the down product reads its input -> dh_out;
                 folds dh_in into h)                                                  2
    mamba2+attention (Falcon-H1: both mixers on one norm, their outputs summed)
                 rmsnorm_linear twice (in_proj, qkv), ssd_conv_step (folds), gated_out_proj,
                 the attention's three, out_product (o_proj; both add into dh_out)   7

and around the sublayers the Mamba steps' embed (times the family's embedding multiplier)
and lm_head (its logits multiplier folded into the final norm's weights: the logits are
linear in them).

Why two pending shares that take turns: the Mamba steps fold dh into h in the kernel between
in_proj and out_proj, after the norm has read h + dh and before out_proj adds the next
share. An MLP has no kernel between its two products, so its down product folds the share
its norm read while it adds its own, and the two cannot be one buffer: each sublayer adds
into the share the sublayer before it read (folded and zeroed by then), and the next reads.

A row's result does not depend on the batch (every sum in a fixed order; the decode
attention's splits by the row's own length). The KV cache's books are the engine's: the
step stores each new key and value at its slot's length and advances the lengths on the
device, as the serving engine's CUDA graphs run it (kv_host=False).
"""

from __future__ import annotations

import torch

from .decode_step_mamba2 import Mamba2DecodeStep
from .paged_attention import decode_attention

# the sublayer kinds this step runs (core/layers.LAYER_KINDS' names); a model with others
# (experts, Mamba-1 mixers) decodes through its layers over the GPU ops
ONE_ROW_KINDS = ("mamba2", "attention", "mlp", "mamba2+attention")


class HybridDecodeStep(Mamba2DecodeStep):
    """The one-row step of a hybrid of ONE_ROW_KINDS' sublayers (see the module's doc): Mamba-2's
    step's buffers, kernels and launch settings; the attention's and MLP's products take
    in_proj's settings (rmsnorm_linear) and out_proj's (out_product)."""

    def __init__(self, model, batch: int, plan, paged_tiles):
        c = model.config
        other = sorted(set(c.kinds) - set(ONE_ROW_KINDS))
        if other:
            raise ValueError(f"the one-row hybrid step runs {', '.join(ONE_ROW_KINDS)} sublayers, not {', '.join(other)}")
        super().__init__(model, batch, plan)
        dev, f32 = model.weights.embedding.device, torch.float32
        self.paged_tiles = paged_tiles
        self.dh2 = torch.zeros_like(self.dh)  # the second pending share (see the module's doc)
        if c.n_attention:
            self.qkv = torch.zeros(batch, (c.attn_heads + 2 * c.kv_heads) * c.attn_head_dim, device=dev, dtype=f32)
            self.rows = torch.arange(batch, device=dev)  # (the slots: the pool's first rows)
        if "mlp" in c.kinds:
            self.mlp_in = torch.zeros(batch, (2 if c.mlp_gated else 1) * c.mlp_size, device=dev, dtype=f32)
        w = model.weights
        self.norm_f = w.norm_f * c.logits_multiplier if c.logits_multiplier != 1.0 else w.norm_f
        # each sublayer's recurrent state's index (among the Mamba sublayers) and KV cache's
        # (among the attention sublayers)
        self.memory_at, r, a = [], 0, 0
        for kind in c.kinds:
            self.memory_at.append((r, a))
            r, a = r + kind.startswith("mamba"), a + kind.endswith("attention")

    def attend(self, lw, kv, layer: int) -> torch.Tensor:
        """The new tokens' queries and keys (in qkv) rotated, their keys and values stored at
        their slots' lengths, each query against its slot's context -> (B, H hd) f32."""
        c = self.model.config
        return decode_attention(self.qkv, kv.k[layer], kv.v[layer], kv.table, kv.lengths, self.rows, c.attn_heads,
                                c.attn_scale or c.attn_head_dim**-0.5, c.rope_theta, c.rotary_dim, tiles=self.paged_tiles)

    def __call__(self, tokens: torch.Tensor, state, argmax: bool = False, h: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; updates `state` (its Mamba states, and its KV
        cache's first B slots, their lengths advanced by one). With argmax, take_argmax must
        follow (see DecodeStep)."""
        assert h is None, "a hybrid's step takes tokens"
        kv = state.kv
        if kv is not None and state.kv_host:
            raise ValueError("the one-row hybrid step stores keys and values in slots 0 .. B-1 with their blocks "
                             "reserved by the engine (a state with kv_host=False), as the engine's CUDA graphs run it")
        c, w = self.model.config, self.model.weights
        self.embed(tokens.contiguous(), dh2=self.dh2, mult=c.embedding_multiplier)
        dh_in, dh_out = self.dh, self.dh2
        for kind, lw, (r, a) in zip(c.kinds, w.layers, self.memory_at):
            linear = dict(blocks=self.in_proj_blocks, sum_last=self.sum_last, unroll=self.in_proj_unroll,
                          mma=self.in_proj_mma, dh=dh_in)
            if kind == "mamba2":
                self._rmsnorm_linear(lw.norm_w, lw.in_proj_w, lw.in_proj_b, self.zxbcdt, **linear)
                self.ssd_conv_step(lw, state.conv[r], state.ssm[r], fold=dh_in)
                self.gated_out_proj(lw, state.conv[r], dh=dh_out)
            elif kind == "attention":
                self._rmsnorm_linear(lw.norm_w, lw.qkv_w, lw.qkv_b, self.qkv, **linear)
                self.out_product(self.attend(lw, kv, a), lw.o_w, lw.o_b, dh_out, fold=dh_in)
            elif kind == "mlp":
                self._rmsnorm_linear(lw.norm_w, lw.in_w, lw.in_b, self.mlp_in, **linear)
                self.out_product(self.mlp_in, lw.out_w, lw.out_b, dh_out, act=c.mlp_act, gated=c.mlp_gated, fold=dh_in)
            else:  # mamba2+attention: both read h + dh_in before ssd_conv_step folds it
                m, at = lw.mamba, lw.attention
                self._rmsnorm_linear(lw.norm_w, m.in_proj_w, m.in_proj_b, self.zxbcdt, **linear)
                self._rmsnorm_linear(lw.norm_w, at.qkv_w, at.qkv_b, self.qkv, **linear)
                self.ssd_conv_step(m, state.conv[r], state.ssm[r], fold=dh_in)
                self.gated_out_proj(m, state.conv[r], dh=dh_out)
                self.out_product(self.attend(at, kv, a), at.o_w, at.o_b, dh_out)
            dh_in, dh_out = dh_out, dh_in
        if kv is not None:
            kv.lengths[: self.B] += 1
        self.lm_head(argmax, norm_f=self.norm_f, dh=dh_in)
        return self.logits[: self.B]

"""A mixture of experts' routed MLPs in two grouped products (`moe_ffn_triton`), and their
pure-PyTorch twin (`moe_ffn_ref`: the CPU path and the oracle).

Each token picks k experts (N tokens: P = N k (token, pick) pairs; pair n k + j is token n's
j-th pick). `moe_align` sorts the pairs by expert (stable: each expert's in token order) and
pads each expert's run to whole blocks of `bm` rows, on the device, without the host learning
any count: its buffers are sized by N, k, E and bm alone (at most P + min(E, P) (bm - 1) rows),
and the number of blocks in use stays a device tensor that the kernel's programs read, so the
launch could sit in a CUDA graph. `_moe_gemm_kernel` runs one block of pairs (all of one
expert) against a tile of that expert's output columns: it gathers the pairs' rows of x,
multiplies by the expert's matrix (16-bit or float32 weights, or e4m3 with a scale a row,
SCALED), sums in float32 and writes each pair's own row of the output, so no two programs
touch one element (no atomics). It runs twice: gate and up in one pass over the (E, 2 I, d)
matrix with the family's activation in its epilogue (ACT: gated SiLU `silu(gate) * up`,
Granite's and Jamba's; squared ReLU, Nemotron-H's ungated experts), then down over (E, d, I)
with each pair's router weight multiplied in (MUL_WEIGHT). A token's k rows are then added
in pick order, as the twin adds them.

Batch invariance: a pair's row is one fixed sum, its K walked in `bk` steps from 0 in the
same tiles whatever else is in its block (the tensor cores treat each row alone, as
products.py's GEMM relies on; the padding rows are zeros), and a token's picks add in a fixed
order; so given its routing and the same MoETiles, a token's output is bitwise the same alone
or in any batch. The tiles come from the caller (engine/plan.py's MOE_TILES): a MoELaunch
picks one set by the launch's token count, which a step that must be batch-invariant pins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ._triton import jit, tl, triton
from .activations import activate
from .fp8_gemm import linear_ref, weight_parts
from .mlp_activation import ACTIVATIONS, mlp_activation_ref
from .products import tensor_dot


@dataclass(frozen=True)
class MoETiles:
    """The grouped products' launch settings. A token's bits depend on them: where they are
    chosen by the launch's token count (MoELaunch), a token's bits depend on that count too."""

    bm: int  # pairs a block (moe_align pads each expert's pairs to whole blocks): a program's rows
    bn: int  # output columns a program
    bk: int  # steps of K a loop iteration
    warps: int
    stages: int  # loads in flight (tl.range num_stages)
    # the most pairs grouped by one program (`moe_align_triton`: one launch, its compares grow
    # as P^2); past it, two launches over chunks of `align_chunk` pairs (a multiple of 32).
    # Both give moe_align's ids.
    align_pairs: int
    align_chunk: int

    def for_tokens(self, n: int) -> "MoETiles":  # (one set: the same at any count, as MoELaunch's pick)
        return self


@dataclass(frozen=True)
class MoELaunch:
    """The grouped products' tiles by a launch's token count (engine/plan.py's MOE_TILES):
    `few` below `many_from` tokens (decode's batches: each expert's few pairs in small
    blocks), `many` from there (prefill's chunks). A step that must give a token the same
    bits at any batch size takes one of them at every count."""

    few: MoETiles
    many: MoETiles
    many_from: int

    def for_tokens(self, n: int) -> MoETiles:
        return self.many if n >= self.many_from else self.few


def route_ref(logits: torch.Tensor, router: str, k: int, bias: torch.Tensor | None = None, groups: int = 1,
              topk_groups: int = 1, norm_topk: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's logits (N, E) f32 -> each token's experts (N, k) int64 and their weights (N, k)
    f32, as transformers routes, call for call (its tie order): "softmax" (Granite) the softmax
    of the top k logits; "softmax_all" (Jamba) the top k of the softmax over every expert, as
    they are; "sigmoid" (Nemotron-H) sigmoid scores, `bias` added for the choice alone, the
    choice limited to the topk_groups best of `groups` groups (a group's score: its two best),
    the picked scores renormalized where norm_topk, then scaled."""
    if router == "softmax":
        top, experts = logits.topk(k, dim=-1)  # (N, k)
        return experts, torch.softmax(top, dim=-1)
    if router == "softmax_all":
        weights, experts = torch.softmax(logits, dim=-1).topk(k, dim=-1)  # (N, k)
        return experts, weights
    scores = logits.sigmoid()  # (N, E)
    choice = scores + bias if bias is not None else scores
    E = logits.shape[-1]
    if groups > 1:
        group_scores = choice.view(-1, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
        picked = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, picked, 1).bool()  # (N, G)
        choice = choice.masked_fill(~keep.repeat_interleave(E // groups, dim=1), float("-inf"))
    experts = torch.topk(choice, k=k, dim=-1, sorted=False)[1]  # (N, k)
    weights = scores.gather(1, experts)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * scaling


@jit
def _route_kernel(logits_ptr, bias_ptr, experts_ptr, weights_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                  BE: tl.constexpr, ROUTER: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    # One program a token: route_ref's routing without groups, its picks in descending order of
    # the choice (equal choices: the lowest expert first), in one launch where the torch ops
    # took two (softmax routers) to eight (sigmoid).
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    emask = e < E
    x = tl.load(logits_ptr + n * E + e, mask=emask, other=float("-inf"))
    if ROUTER == "sigmoid":
        scores = tl.sigmoid(x)
        choice = scores
        if HAS_BIAS:
            choice += tl.load(bias_ptr + e, mask=emask, other=0.0)
        choice = tl.where(emask, choice, float("-inf"))
    elif ROUTER == "softmax_all":
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
        choice = tl.where(emask, scores, float("-inf"))
    else:  # softmax: of the picked logits, below
        scores = x
        choice = x
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    vals = tl.zeros([KP], dtype=tl.float32)
    for t in tl.static_range(K):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, e, BE), axis=0)
        ids = tl.where(j == t, pick, ids)
        vals = tl.where(j == t, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), vals)
        choice = tl.where(e == pick, float("-inf"), choice)
    kmask = j < K
    if ROUTER == "softmax":
        p = tl.where(kmask, tl.exp(vals - tl.max(tl.where(kmask, vals, float("-inf")), axis=0)), 0.0)
        vals = p / tl.sum(p, axis=0)
    elif ROUTER == "sigmoid":
        if NORM:
            vals = vals / (tl.sum(tl.where(kmask, vals, 0.0), axis=0) + 1e-20)
        vals = vals * scaling
    tl.store(experts_ptr + n * K + j, ids.to(tl.int64), mask=kmask)
    tl.store(weights_ptr + n * K + j, vals, mask=kmask)


def route_triton(logits: torch.Tensor, router: str, k: int, bias: torch.Tensor | None = None, groups: int = 1,
                 topk_groups: int = 1, norm_topk: bool = True, scaling: float = 1.0):
    """route_ref's experts and weights in one launch (its picks in descending order of the
    choice); groups of experts (no public checkpoint's) through route_ref."""
    if groups > 1:
        return route_ref(logits, router, k, bias, groups, topk_groups, norm_topk, scaling)
    N, E = logits.shape
    experts = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    if N:
        _route_kernel[(N,)](logits.float().contiguous(), bias if bias is not None else logits, experts, weights, E,
                            float(scaling), K=k, KP=triton.next_power_of_2(k), BE=triton.next_power_of_2(E),
                            ROUTER=router, HAS_BIAS=bias is not None, NORM=norm_topk, num_warps=1 if E <= 128 else 4)
    return experts, weights


def moe_align(experts: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts (N, k) int -> (ids (R,) int64, block_expert (R / block_m,) int64, blocks (1,) int64).

    ids: the pairs (n k + j) grouped by expert (in expert order, each expert's in pair order),
    each expert's run padded with P = N k to a whole number of blocks of block_m rows;
    block_expert[b]: block b's expert (n_experts past the blocks in use); blocks: how many
    are in use. R = block_m * floor((P + min(E, P) (block_m - 1)) / block_m), the most a routing
    can need. Device ops alone (no count reaches the host); no atomics. The twin and oracle
    of moe_align_triton, which the grouped products take."""
    pairs = experts.flatten()  # (P,)
    P, dev = pairs.numel(), pairs.device
    order = torch.argsort(pairs, stable=True)  # (P,) the pairs by expert, each expert's in pair order
    by_expert = pairs[order]  # (P,) sorted
    # each expert's first position in the sorted pairs (and the end): counts without a histogram
    starts = torch.searchsorted(by_expert, torch.arange(n_experts + 1, device=dev, dtype=by_expert.dtype))  # (E + 1,)
    counts = starts[1:] - starts[:-1]  # (E,)
    blocks = (counts + block_m - 1) // block_m  # (E,)
    block_end = torch.cumsum(blocks, 0)  # (E,)
    n_blocks = (P + min(n_experts, P) * (block_m - 1)) // block_m
    rank = torch.arange(P, device=dev) - starts[:-1][by_expert]  # (P,) each pair's place among its expert's
    ids = torch.full((n_blocks * block_m,), P, dtype=torch.int64, device=dev)
    ids[(block_end - blocks)[by_expert] * block_m + rank] = order
    block_expert = torch.bucketize(torch.arange(n_blocks, device=dev), block_end, right=True)  # (n_blocks,)
    return ids, block_expert, block_end[-1:]


@jit(do_not_specialize=["P", "E", "R"])
def _align_kernel(experts_ptr, ids_ptr, bexp_ptr, nblocks_ptr, P, E, R, BM: tl.constexpr, BE: tl.constexpr,
                  BC: tl.constexpr):
    # moe_align in one program: each expert's count, its first block (a cumsum over experts),
    # each pair's place among its expert's (the earlier pairs of its expert, counted BC pairs
    # at a time), then ids[first block's row + place] = pair, over a fill of P (padding)
    e_all = tl.arange(0, BE)
    counts = tl.zeros([BE], dtype=tl.int32)
    for q0 in range(0, P, BC):
        q = q0 + tl.arange(0, BC)
        eq = tl.load(experts_ptr + q, mask=q < P, other=E).to(tl.int32)
        counts += tl.sum((eq[None, :] == e_all[:, None]).to(tl.int32), axis=1)
    blocks = (counts + BM - 1) // BM  # (BE,) none for e >= E
    end = tl.cumsum(blocks, axis=0)
    first = end - blocks
    for r0 in range(0, R, BC):
        r = r0 + tl.arange(0, BC)
        tl.store(ids_ptr + r, tl.full([BC], 0, tl.int64) + P, mask=r < R)
    tl.debug_barrier()  # (the fill lands before the pairs' own rows)
    for p0 in range(0, P, BC):
        p = p0 + tl.arange(0, BC)
        pmask = p < P
        ep = tl.load(experts_ptr + p, mask=pmask, other=E).to(tl.int32)
        place = tl.zeros([BC], dtype=tl.int32)
        for q0 in range(0, p0 + BC, BC):
            q = q0 + tl.arange(0, BC)
            eq = tl.load(experts_ptr + q, mask=q < P, other=E).to(tl.int32)
            earlier = (eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None])
            place += tl.sum(earlier.to(tl.int32), axis=1)
        at = tl.sum(tl.where(e_all[None, :] == ep[:, None], first[None, :], 0), axis=1)  # (BC,) its expert's first block
        tl.store(ids_ptr + at.to(tl.int64) * BM + place, p.to(tl.int64), mask=pmask)
    # block b's expert: the experts whose blocks end at or before b (E past the blocks in use)
    for b0 in range(0, R // BM, BC):
        b = b0 + tl.arange(0, BC)
        done = (end[None, :] <= b[:, None]) & (e_all[None, :] < E)
        tl.store(bexp_ptr + b, tl.sum(done.to(tl.int32), axis=1).to(tl.int64), mask=b < R // BM)
    tl.store(nblocks_ptr, tl.sum(tl.where(e_all < E, blocks, 0), axis=0).to(tl.int64))


def moe_align_triton(experts: torch.Tensor, n_experts: int, block_m: int, chunk: int | None = None):
    """moe_align in Triton, the same three tensors, bit for bit: in one launch of one program
    (its compares grow as P^2: decode's few pairs), or in two launches over chunks of `chunk`
    pairs (a multiple of 32: a prefill's many pairs; a program's compares grow as chunk^2, its
    reads of all chunks' counts as P / chunk)."""
    pairs = experts.flatten().contiguous()  # (P,)
    P, dev = pairs.numel(), pairs.device
    n_blocks = (P + min(n_experts, P) * (block_m - 1)) // block_m
    ids = torch.empty(n_blocks * block_m, dtype=torch.int64, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int64, device=dev)
    blocks = torch.empty(1, dtype=torch.int64, device=dev)
    BE = triton.next_power_of_2(n_experts + 1)
    if chunk is None:
        _align_kernel[(1,)](pairs, ids, block_expert, blocks, P, n_experts, n_blocks * block_m, BM=block_m, BE=BE,
                            BC=32, num_warps=4)
        return ids, block_expert, blocks
    C = triton.cdiv(P, chunk)
    counts = torch.empty(C, BE, dtype=torch.int32, device=dev)
    _align_count_kernel[(C,)](pairs, counts, P, E=n_experts, BE=BE, CHUNK=chunk, BC=32, num_warps=4)
    _align_place_kernel[(C,)](pairs, counts, ids, block_expert, blocks, P, C, n_experts, n_blocks * block_m,
                              BM=block_m, BE=BE, CHUNK=chunk, BC=32, num_warps=4)
    return ids, block_expert, blocks


@jit(do_not_specialize=["P"])
def _align_count_kernel(experts_ptr, counts_ptr, P, E: tl.constexpr, BE: tl.constexpr, CHUNK: tl.constexpr,
                        BC: tl.constexpr):
    # counts[c, e]: chunk c's pairs of expert e
    c = tl.program_id(0)
    e_all = tl.arange(0, BE)
    counts = tl.zeros([BE], dtype=tl.int32)
    for q0 in range(c * CHUNK, c * CHUNK + CHUNK, BC):
        q = q0 + tl.arange(0, BC)
        eq = tl.load(experts_ptr + q, mask=q < P, other=E).to(tl.int32)
        counts += tl.sum((eq[None, :] == e_all[:, None]).to(tl.int32), axis=1)
    tl.store(counts_ptr + c * BE + e_all, counts)


@jit(do_not_specialize=["P", "C", "E", "R"])
def _align_place_kernel(experts_ptr, counts_ptr, ids_ptr, bexp_ptr, nblocks_ptr, P, C, E, R, BM: tl.constexpr,
                        BE: tl.constexpr, CHUNK: tl.constexpr, BC: tl.constexpr):
    # Chunk c's program: every expert's count and first block from all chunks' counts; its
    # pairs' places (the pairs of their expert in earlier chunks, then earlier in its own);
    # then its share of the rows that no pair takes (padding: P) and of the blocks' experts.
    # Each row is written by one program alone: no atomics, no order between programs.
    c = tl.program_id(0)
    e_all = tl.arange(0, BE)
    total = tl.zeros([BE], dtype=tl.int32)
    before = tl.zeros([BE], dtype=tl.int32)  # (BE,) pairs of each expert in chunks before c
    for c2 in range(0, C):
        n = tl.load(counts_ptr + c2 * BE + e_all)
        total += n
        before += tl.where(c2 < c, n, 0)
    blocks = (total + BM - 1) // BM  # (BE,) none for e >= E
    end = tl.cumsum(blocks, axis=0)
    first = end - blocks
    for p0 in range(c * CHUNK, c * CHUNK + CHUNK, BC):
        p = p0 + tl.arange(0, BC)
        pmask = p < P
        ep = tl.load(experts_ptr + p, mask=pmask, other=E).to(tl.int32)
        mine = ep[:, None] == e_all[None, :]  # (BC, BE)
        place = tl.sum(tl.where(mine, before[None, :], 0), axis=1)
        for q0 in range(c * CHUNK, p0 + BC, BC):
            q = q0 + tl.arange(0, BC)
            eq = tl.load(experts_ptr + q, mask=q < P, other=E).to(tl.int32)
            earlier = (eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None])
            place += tl.sum(earlier.to(tl.int32), axis=1)
        at = tl.sum(tl.where(mine, first[None, :], 0), axis=1)  # (BC,) its expert's first block
        tl.store(ids_ptr + at.to(tl.int64) * BM + place, p.to(tl.int64), mask=pmask)
    # rows [c R', (c + 1) R') of R' = ceil(R / C): row r's block b's expert is the number of
    # experts whose blocks end at or before b (E past the blocks in use); the row is padding
    # where its place in the expert's run is past the expert's count
    share = tl.cdiv(R, C)
    for r0 in range(c * share, c * share + share, BC):
        r = r0 + tl.arange(0, BC)
        rmask = (r < R) & (r < c * share + share)
        b = r // BM
        done = (end[None, :] <= b[:, None]) & (e_all[None, :] < E)
        eb = tl.sum(done.to(tl.int32), axis=1)  # (BC,)
        its = eb[:, None] == e_all[None, :]
        start = tl.sum(tl.where(its, first[None, :], 0), axis=1) * BM
        count = tl.sum(tl.where(its, total[None, :], 0), axis=1)
        pad = (eb >= E) | (r - start >= count)
        tl.store(ids_ptr + r, tl.full([BC], 0, tl.int64) + P, mask=rmask & pad)
        tl.store(bexp_ptr + b, eb.to(tl.int64), mask=rmask & (r % BM == 0))
    if c == 0:
        tl.store(nblocks_ptr, tl.sum(tl.where(e_all < E, blocks, 0), axis=0).to(tl.int64))


@jit
def _sum_picks_kernel(y_ptr, add_ptr, out_ptr, D, K: tl.constexpr, BD: tl.constexpr, HAS_ADD: tl.constexpr):
    # out[n] = y[n, 0] + y[n, 1] + ... in pick order (+ add[n] last: the shared MLP's output),
    # the twin's order: the same bits
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = d < D
    acc = tl.load(y_ptr + n * K * D + d, mask=dmask)
    for j in tl.static_range(1, K):
        acc = acc + tl.load(y_ptr + (n * K + j) * D + d, mask=dmask)
    if HAS_ADD:
        acc = acc + tl.load(add_ptr + n * D + d, mask=dmask)
    tl.store(out_ptr + n * D + d, acc, mask=dmask)


def moe_ffn_ref(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, in_w, out_w, act: str, gated: bool,
                add: torch.Tensor | None = None, linear: Callable = linear_ref) -> torch.Tensor:
    """x (N, d), experts (N, k) int, weights (N, k) f32, in_w (E, 2 I, d) gated (gate's rows,
    then up's) or (E, I, d), out_w (E, d, I) (tensors, or FP8 weights: `w[e]` one expert's)
    -> (N, d) f32: each token's experts' MLPs weighted by the router, summed in pick order,
    then `add` (N, d) f32 where given (the shared MLP's output). One product an expert with
    tokens (the host reads the counts); linear(x, w): the product (the reference ops' own)."""
    N, d = x.shape
    k = experts.shape[1]
    pairs = experts.flatten()  # (N k,) pair n * k + j: token n's j-th pick
    order = torch.argsort(pairs, stable=True)  # the pairs grouped by expert, each group in token order
    counts = torch.bincount(pairs, minlength=in_w.shape[0]).tolist()  # (the host learns each expert's rows)
    y = torch.zeros(pairs.shape[0], d, dtype=torch.float32, device=x.device)  # (N k, d) a row a pair
    at = 0
    for e, n in enumerate(counts):
        if n == 0:  # (an expert no token picked: no product)
            continue
        rows = order[at : at + n]  # (n,)
        at += n
        a = linear(x[rows // k], in_w[e])  # (n, 2 I) gated, (n, I) not
        h = mlp_activation_ref(a, act, gated)
        y[rows] = linear(h, out_w[e]).float()
    y = y.view(-1, k, d)
    routed = y[:, 0] * weights[:, :1]
    for j in range(1, k):  # (in pick order: the same sum whatever the batch)
        routed = routed + y[:, j] * weights[:, j : j + 1]
    return routed if add is None else routed + add


@jit(do_not_specialize=["P"])
def _moe_gemm_kernel(
    x_ptr, w_ptr, s_ptr, rw_ptr, ids_ptr, bexp_ptr, nblocks_ptr, out_ptr, P, N, K, ROW_DIV,
    ACT: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, F32: tl.constexpr, SCALED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):
    # out[pair, n] = act(x[pair // ROW_DIV] @ w[e, n]) (gated: act(gate) * up, up's row n + N)
    # (* weight[pair]) for each pair of block pid_b, all of expert e. (P is not specialised on
    # its value: the code must not change with the batch.)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(nblocks_ptr):  # (a block past the routing's: the grid is sized for the most)
        return
    e = tl.load(bexp_ptr + pid_b).to(tl.int64)
    pairs = tl.load(ids_ptr + pid_b * BM + tl.arange(0, BM))  # (BM,) P: padding
    rmask = pairs < P
    rows = (pairs // ROW_DIV).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < N
    W: tl.constexpr = 2 if GATED else 1  # the matrix's rows, in N's
    w_at = w_ptr + e * W * N * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        a = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_at + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
        if SCALED:  # e4m3 values, widened exactly to the operand's dtype
            w = w.to(x_ptr.dtype.element_ty)
        acc = tensor_dot(a, tl.trans(w), acc, F32)
        if GATED:
            wu = tl.load(w_at + (N + n)[:, None] * K + k[None, :], mask=wmask, other=0.0)
            if SCALED:
                wu = wu.to(x_ptr.dtype.element_ty)
            up = tensor_dot(a, tl.trans(wu), up, F32)
    if SCALED:  # an FP8 weight's row scales, once on each sum
        acc *= tl.load(s_ptr + e * W * N + n, mask=nmask, other=0.0)[None, :]
        if GATED:
            up *= tl.load(s_ptr + e * W * N + N + n, mask=nmask, other=0.0)[None, :]
    if ACT != "none":
        acc = activate(acc, ACT)
    if GATED:
        acc = acc * up
    if MUL_WEIGHT:  # the router's weight of each pair
        acc *= tl.load(rw_ptr + pairs, mask=rmask, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def _parts(weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stacked experts (E, out, in) as contiguous (values, row scales (E, out) or None)
    (fp8_gemm.weight_parts), block-scaled FP8 refused by name."""
    if getattr(weight, "block", None) is not None:
        raise ValueError(f"the fused MoE kernel takes FP8 experts with a scale a row; these have {weight.block} "
                         "block scales: use engine='reference'")
    values, scale = weight_parts(weight)
    return values.contiguous(), None if scale is None else scale.contiguous()


def _grouped_product(x, w, scale, weights, ids, block_expert, blocks, out, N, row_div, act, gated, mul_weight, tiles):
    P = weights.numel()
    grid = (block_expert.shape[0], triton.cdiv(N, tiles.bn))
    _moe_gemm_kernel[grid](x, w, scale if scale is not None else w, weights, ids, block_expert, blocks, out, P, N,
                           x.shape[1], row_div, ACT=act, GATED=gated, MUL_WEIGHT=mul_weight,
                           F32=x.dtype == torch.float32, SCALED=scale is not None, BM=tiles.bm, BN=tiles.bn,
                           BK=tiles.bk, STAGES=tiles.stages, num_warps=tiles.warps)


def moe_ffn_triton(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, in_w, out_w, act: str, gated: bool,
                   add: torch.Tensor | None = None, *, tiles: MoETiles | MoELaunch) -> torch.Tensor:
    """moe_ffn_ref through the grouped kernel: x rounded once to the weights' operand dtype
    (their own for 16-bit and float32 weights (float32 in three TF32 passes), bfloat16 for
    e4m3 ones, whose values widen to it exactly), float32 sums, the hidden activations
    stored in the down matrix's operand dtype, the output (N, d) f32 (`add` in the picks' sum's
    launch). No host sync."""
    N, d = x.shape
    k = experts.shape[1]
    w1, s1 = _parts(in_w)
    w2, s2 = _parts(out_w)
    E, I = w1.shape[0], w1.shape[1] // 2 if gated else w1.shape[1]
    if act not in ACTIVATIONS:
        raise ValueError(f"the fused MoE kernel has no activation {act!r} (it has {', '.join(ACTIVATIONS)})")
    if N * k == 0:
        zeros = torch.zeros(N, d, dtype=torch.float32, device=x.device)
        return zeros if add is None else zeros + add
    tiles = tiles.for_tokens(N)
    operand1 = torch.bfloat16 if s1 is not None else w1.dtype
    operand2 = torch.bfloat16 if s2 is not None else w2.dtype
    ids, block_expert, blocks = moe_align_triton(experts, E, tiles.bm, None if N * k <= tiles.align_pairs else tiles.align_chunk)
    rw = weights.float().contiguous().view(-1)  # (P,)
    h = torch.empty(N * k, I, dtype=operand2, device=x.device)  # (P, I) a row a pair
    _grouped_product(x.to(operand1).contiguous(), w1, s1, rw, ids, block_expert, blocks, h, I, k, act, gated, False,
                     tiles)
    y = torch.empty(N * k, d, dtype=torch.float32, device=x.device)  # (P, d) a row a pair, router-weighted
    _grouped_product(h, w2, s2, rw, ids, block_expert, blocks, y, d, 1, "none", False, True, tiles)
    if k == 1:
        return y if add is None else y + add
    routed = torch.empty(N, d, dtype=torch.float32, device=x.device)
    add = add.float().contiguous() if add is not None else None
    _sum_picks_kernel[(N, triton.cdiv(d, 1024))](y, add if add is not None else y, routed, d, K=k, BD=1024,
                                                 HAS_ADD=add is not None, num_warps=4)
    return routed

"""Times the hybrids' paged decode attention (kernels/paged_attention.paged_decode: the splits
and their sum) at the public shapes' heads for several PagedTiles, bf16 keys and values in
16-token blocks scattered over the pool, against the floor: every row's keys and values read
once at the copy rate. Chooses engine/plan.py's PAGED_TILES, whose splits may follow a model's
heads but never the batch or the context (a row's sums are added in the splits' order).

    python -m benchmarks.tune_paged --contexts 1024,16384 --batches 1,32,128
"""

import argparse
from dataclasses import replace

import torch
from triton.testing import do_bench

from fastmamba.bench import HYBRID_SHAPES, copy_bandwidth
from fastmamba.core.config import MambaConfig
from fastmamba.engine.plan import PAGED_TILES
from fastmamba.kernels.paged_attention import paged_decode

BLOCK = 16  # the KV cache's block size (core/kv_cache.KVCache)


def case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int):
    """A query a row and `context` keys and values a row in its own scattered blocks."""
    g = torch.Generator(device="cuda").manual_seed(0)
    per_row = -(-context // BLOCK)
    k, v = (torch.randn(batch * per_row, BLOCK, kv_heads, head_dim, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    table = torch.randperm(batch * per_row, device="cuda", generator=g).view(batch, per_row)
    lengths = torch.full((batch,), context, device="cuda", dtype=torch.int64)
    q = torch.randn(batch, heads, head_dim, device="cuda", generator=g)
    return q, k, v, table, lengths


def timed(name: str, c: MambaConfig, batch: int, context: int, counts: list[int], rate: float) -> str:
    """A line: the kernels' µs and fraction of the floor at each count of a row's programs."""
    H, KVH, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    q, k, v, table, lengths = case(batch, context, H, KVH, hd)
    floor_us = 2 * batch * context * KVH * hd * 2 / rate * 1e6
    first, cells = None, []
    for programs in counts:
        t = replace(PAGED_TILES, programs=programs)
        out = paged_decode(q, k, v, table, lengths, hd**-0.5, tiles=t)
        first = out if first is None else first
        # (other splits: each split's weights are relative to its own largest score and rounded
        # to the cache's dtype before the values' product, so the rows differ by bf16 rounding)
        assert (out - first).abs().max() <= 1e-2 * first.abs().max(), (name, programs)
        us = do_bench(lambda: paged_decode(q, k, v, table, lengths, hd**-0.5, tiles=t), warmup=10, rep=50) * 1e3
        cells.append(f"{programs} ({max(1, programs // KVH)} splits) {us:.1f} us {floor_us / us:.2f}")
    return (f"{name} ({H}/{KVH} heads of {hd}) batch {batch} context {context}, floor {floor_us:.1f} us: "
            + "; ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="nemotron-h-8b,granite-4.0-h-micro,falcon-h1-7b,nemotron-3-nano-30b-a3b")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--programs", default="32,64,128,256", help="a row's programs, besides 16 splits a head")
    args = ap.parse_args()
    rate = copy_bandwidth()  # (bytes a second)
    print(f"{torch.cuda.get_device_name()}, copy {rate / 1e12:.2f} TB/s; the plan's tiles: {PAGED_TILES}")
    for name in args.shapes.split(","):
        c = MambaConfig.from_dict(HYBRID_SHAPES[name], name)
        # (16 splits a head: the split count before the splits followed the heads)
        counts = sorted({16 * c.kv_heads, PAGED_TILES.programs, *(int(p) for p in args.programs.split(","))})
        for context in (int(x) for x in args.contexts.split(",")):
            for batch in (int(x) for x in args.batches.split(",")):
                print(timed(name, c, batch, context, counts, rate), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

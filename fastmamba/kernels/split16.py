"""Float32 activations as two 16-bit halves, so a 16-bit product keeps about 16 bits of them.

A 16-bit product (cuBLAS, tensor cores) rounds its activations to 8 (bf16) or 11 (fp16)
mantissa bits; on real-shape models that alone moves bf16 logits by 2-5% against the float32
reference. Writing v as hi = round(v) and lo = round(v - hi) in rows [0, B) and [B, 2B) of
one (2B, K) operand costs a product twice as tall but still one read of the weights; the
consumer adds the two halves of the float32 result. A result may come in more parts than
two (load_sum's PARTS): the deterministic step's products split over K (products.py) write each
chunk's share of both halves apart.
"""

from ._triton import jit, tl


@jit
def store_split(ptr, offs, v, lo, mask, SPLIT: tl.constexpr):
    """v (float32) into ptr's dtype at offs, and with SPLIT its remainder at offs + lo."""
    hi = v.to(ptr.dtype.element_ty)
    tl.store(ptr + offs, hi, mask=mask)
    if SPLIT:
        tl.store(ptr + lo + offs, (v - hi.to(tl.float32)).to(ptr.dtype.element_ty), mask=mask)


@jit
def load_sum(ptr, offs, lo, mask, PARTS: tl.constexpr):
    """The float32 value at offs plus those at offs + lo, offs + 2 lo, ..., PARTS of them,
    added in that order."""
    v = tl.load(ptr + offs, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):
        v += tl.load(ptr + p * lo + offs, mask=mask, other=0.0)
    return v

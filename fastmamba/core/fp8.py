"""FP8 weights (`dtype="fp8"`): a large matrix stored as float8 e4m3 values with float32
scales, quantized at load or read as a published FP8 checkpoint holds it, and its product on
the reference engine.

A row's scale is its largest magnitude over e4m3's largest value (448), so the row's values
span e4m3's whole range; each value is w / scale rounded to the nearest e4m3 value (ties to
even), saturating at +-448. Published checkpoints may carry a scale per block of the matrix
instead (DeepSeek-V3's 128 x 128): `Fp8Weight.block` then says the block's shape. The product
multiplies in float32 and applies the scales to the sums, so a decode step reads one byte a
weight and the accumulation stays float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Every e4m3 value as float32, by its byte: a lookup converts a matrix 5x faster on the CPU than
# torch's float8 conversion (1280 x 320, one thread: 0.33 against 1.8 ms), which a decode
# step pays for every matrix
_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()
QUANTIZE_BLOCK = 1 << 25  # quantize's block of rows: 128 MB of float32 temporaries at most


def values(data: torch.Tensor) -> torch.Tensor:
    """e4m3 values (any shape) as float32, exactly: on the CPU through the table, on a GPU
    through torch's own conversion (no copy of the table from the host, which a CUDA graph
    being captured could not take)."""
    if data.device.type != "cpu":
        return data.float()
    return _VALUES.index_select(0, data.view(torch.uint8).flatten().int()).view(data.shape)


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """A matrix (out, in) as e4m3 values and float32 scales: w ~ data * scale, a scale per
    output row (scale (out,)), or per block of `block` = (rows, columns) (scale
    (ceil(out / rows), ceil(in / columns)), the last blocks cut short by the matrix's edge).
    A mixture of experts' stacked matrices (E, out, in) have a scale a row (E, out); `w[e]`
    is expert e's matrix."""

    data: torch.Tensor  # (out, in) float8_e4m3fn
    scale: torch.Tensor  # (out,) float32, or (out / rows, in / columns) rounded up with `block`
    block: tuple[int, int] | None = None

    dtype = FP8  # the storage dtype, as a tensor's .dtype says it

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: the values and the scales."""
        return self.data.nbytes + self.scale.nbytes

    def __getitem__(self, e: int) -> Fp8Weight:
        """Matrix e of stacked matrices (E, out, in), as a view."""
        return Fp8Weight(self.data[e], self.scale[e], self.block)

    def row_scales(self) -> torch.Tensor:
        """Each element's scale (out, in) f32 for block scales; (..., out, 1) for a scale a row."""
        if self.block is None:
            return self.scale[..., None]
        rows, cols = self.block
        out, k = self.data.shape
        return self.scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :k]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix as data * scale (float32 arithmetic, one rounding), then in `dtype`."""
        return (values(self.data) * self.row_scales()).to(dtype)

    def to(self, device) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.block)

    def scale_rows(self, rows: slice, by: float) -> Fp8Weight:
        """The matrix with rows `rows` multiplied by `by` (a model family's multiplier folded
        in at load), through the scales alone; block scales need the rows to be whole blocks."""
        scale = self.scale.clone()
        if self.block is None:
            scale[rows] *= by
            return Fp8Weight(self.data, scale, None)
        h, out = self.block[0], self.data.shape[0]
        start, stop, _ = rows.indices(out)
        if start % h or (stop % h and stop != out):
            raise ValueError(f"rows {start}:{stop} are not whole blocks of {h} rows")
        scale[start // h : -(-stop // h)] *= by
        return Fp8Weight(self.data, scale, self.block)


def cat(weights: list[Fp8Weight]) -> Fp8Weight:
    """Matrices stacked by rows (an MLP's gate and up, one product), their scales with them;
    block scales need every matrix but the last to be whole blocks of rows."""
    block = weights[0].block
    if any(w.block != block for w in weights):
        raise ValueError("the matrices' scales are of different layouts")
    if block is not None and any(w.data.shape[0] % block[0] for w in weights[:-1]):
        raise ValueError(f"the matrices' rows are not whole blocks of {block[0]}")
    return Fp8Weight(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]), block)


def float32_values(m) -> torch.Tensor:
    """A matrix's values in float32: an Fp8Weight's dequantized (exact), a tensor's widened."""
    return m.dequantize() if isinstance(m, Fp8Weight) else m.float()


def cat_rows(matrices: list):
    """Matrices one product reads as one, stacked by rows (an MLP's gate and up; attention's
    q, k and v): tensors, or Fp8Weights with their scales (`cat`); one matrix as it is. Those
    that cannot share one layout (FP8 ones beside 16/32-bit ones that an FP8 checkpoint left
    unquantized, block scales that are not whole blocks of every matrix but the last) are
    stacked as float32 values, which the product reads exactly: a slower product, never a
    refusal."""
    if len(matrices) == 1:
        return matrices[0]
    fp8 = [isinstance(m, Fp8Weight) for m in matrices]
    if not any(fp8):
        return torch.cat(matrices)
    if all(fp8):
        try:
            return cat(matrices)
        except ValueError:
            pass
    return torch.cat([float32_values(m) for m in matrices])


def quantize(w: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Weight:
    """w (out, in) (or stacked experts' (E, out, in)) as e4m3 with a float32 scale a row: by
    default the row's largest magnitude over 448 (1 for a row of zeros); values w / scale
    rounded to nearest, saturating at +-448."""
    rows = w.reshape(-1, w.shape[-1])  # (all rows, in)
    data = torch.empty(rows.shape, dtype=FP8, device=w.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=w.device)
    given = None if scale is None else scale.float().reshape(-1)
    # A block of rows at a time, so that the float32 temporaries stay small beside the matrix
    # (a GPU's load of a 131072 x 4096 head: 0.5 GB of them, not 6); each row alone, as before.
    step = max(1, QUANTIZE_BLOCK // max(1, rows.shape[1]))
    for i in range(0, rows.shape[0], step):
        r = rows[i : i + step].float()
        if given is None:
            amax = r.abs().amax(dim=-1)  # (rows,)
            s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        else:
            s = given[i : i + step]
        data[i : i + step] = (r / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX)  # (the division may pass 448 by an ulp)
        scales[i : i + step] = s
    return Fp8Weight(data.view(w.shape), scales.view(w.shape[:-1]))


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias in float32: the e4m3 values multiply in float32 and the scales apply to
    the sums (a row's; a block's sums over its columns, added), as a GPU kernel reading the
    bytes would. x (..., in) -> (..., out) f32."""
    x = x.float()
    if w.block is None:
        y = F.linear(x, values(w.data)) * w.scale
    else:
        rows, cols = w.block
        out, k = w.data.shape
        row_scale = w.scale.repeat_interleave(rows, 0)[:out]  # (out, in / cols)
        v = values(w.data)
        y = sum(F.linear(x[..., j : j + cols], v[:, j : j + cols]) * row_scale[:, j // cols] for j in range(0, k, cols))
    return y if bias is None else y + bias


def dense(weight):
    """A matrix as a tensor, for a kernel that takes it whole (the scan's step sizes read
    dt_proj): an Fp8Weight dequantized (the scale applied before the sum, not after) to
    float32, on a GPU to bfloat16 (the bfloat16 model's dt_proj: the step sizes' kernel
    takes 16-bit operands on the tensor cores, where float32 takes its slower IEEE path:
    181 µs a layer in 2.8b's 2048-token FP8 prefill on an H100); a tensor as it is."""
    if not isinstance(weight, Fp8Weight):
        return weight
    full = weight.dequantize()
    return full.to(torch.bfloat16) if full.is_cuda else full


def operand_dtype(weight) -> torch.dtype:
    """The dtype a product's input may be rounded to before the product reads it: the
    weight's own for a 16/32-bit matrix, float32 for an FP8 one (its reference multiplies in
    float32; the GPU's FP8 kernels will name theirs)."""
    return torch.float32 if isinstance(weight, Fp8Weight) else weight.dtype


def nbytes(t) -> int:
    """The bytes a tensor or an Fp8Weight holds (None: 0)."""
    if t is None:
        return 0
    return t.nbytes if isinstance(t, Fp8Weight) else t.numel() * t.element_size()


def block_scaled(weights) -> list[str]:
    """The names of a model's (core/model.MambaWeights') block-scaled FP8 matrices, e.g.
    'layers.3.in_proj_w' or 'lm_head': the GPU's FP8 products take a scale a row."""
    found = [f"layers.{i}.{name}" for i, lw in enumerate(weights.layers) for name, t in vars(lw).items()
             if isinstance(t, Fp8Weight) and t.block is not None]
    head = weights.lm_head
    return found + (["lm_head"] if isinstance(head, Fp8Weight) and head.block is not None else [])

"""The plan tables: the kernels' tuned choices, each with its reason. Scripts that try another
choice build their own (dataclasses.replace of an entry here) and pass it.

The decode plan: which decode step runs, with which products, for every model width,
weight dtype, batch size and mode. One table a layer type (ROUTES, MAMBA2_ROUTES), a line
of reason per entry, read by `plan_for`; nothing else in the code holds a routing
threshold. make_decode_step takes a DecodePlan.

The kernels' tiles (at the end): the prefill conv, step sizes and scan, Mamba-2's scan, the
training kernels and the samplers, one instance of each kernel module's settings type
(KERNEL_TILES for the GPU ops, SAMPLER_TILES for the samplers).

The steps (docs/architecture.md, "Plans: the tuned choices"):
- "one-row" (kernels/decode_step.DecodeStep): one row a program, float32 multiply-and-sum
  GEMVs; it reads every weight once a row (the copies after the first from L2), so it wins
  at a few rows and loses as the rows, or the model's width, grow.
- "products" (kernels/decode_gemm.GemmDecodeStep): each projection one matrix product,
  through the batch-invariant Triton GEMM (kernels/products.invariant_gemm) or cuBLAS.
- "layer-ops" (engine/decode_step.OpsDecodeStep): the model's own layers at one token over
  the GPU ops (cuBLAS products, the Triton conv, norms and scan step): Mamba-2's.
  Deterministic: the products through invariant_gemm.
- "one-row" for a Mamba-2 model (kernels/decode_step_mamba2.Mamba2DecodeStep): the Mamba-1
  step's design, three kernels a layer; its own table (MAMBA2_ROUTES) against "layer-ops"
  (`benchmarks/decode_routing.py --models mamba2-130m,...` times both).
A slot's logits are bitwise the same at every batch size within one of
`batch_invariant_ranges` (the one-row step treats each row alone; the Triton products'
sums have a fixed order); cuBLAS picks its algorithm by the shape. `deterministic=True`
runs the all-Triton products step at every batch size.

Evidence (graph-replayed steps): benchmarks/RESULTS.md, "The decode plan's evidence".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fastmamba.core.ops import KernelTiles
from fastmamba.kernels.causal_conv1d import ConvTiles
from fastmamba.kernels.conv_grad import ConvGradTiles
from fastmamba.kernels.decode_gemm import PRODUCTS
from fastmamba.kernels.decode_step_hybrid import ONE_ROW_KINDS
from fastmamba.kernels.lockstep_step import unfit
from fastmamba.kernels.moe import MoELaunch, MoETiles
from fastmamba.kernels.paged_attention import PagedTiles
from fastmamba.kernels.sampler import SamplerTiles
from fastmamba.kernels.scan_grad import TrainScanTiles
from fastmamba.kernels.selective_scan import ScanTiles
from fastmamba.kernels.ssd import SSDTiles
from fastmamba.kernels.ssd_grad import SSDGradTiles
from fastmamba.kernels.step_size import StepSizeTiles

NONE, IN_PROJ, ALL = frozenset(), frozenset({"in_proj"}), frozenset(PRODUCTS)
IN_OUT_PROJ = frozenset({"in_proj", "out_proj"})  # the two large products
# The K chunks each Triton product sums in, fixed per product and never by the batch size
# (they set the order of the sums). The short-and-wide x_proj and out_proj need them for
# enough programs at batch 1; more chunks cost their reads at large batches (2.8b bf16,
# x_proj alone at batch 1: 22.3 µs in one chunk, 7.3 in eight).
SPLITS = (("in_proj", 1), ("x_proj", 8), ("dt_proj", 1), ("out_proj", 4), ("lm_head", 1))
MANY = 1 << 30  # "and above"


@dataclass(frozen=True)
class OneRowBlocks:
    """The one-row step's launch settings. They depend on the model's shapes and dtype
    only, never on the batch size: a row's result must not change with the batch."""

    conv_in_in_proj: bool  # the conv step and x_proj in in_proj's programs; else a conv_x_proj kernel
    conv_block: int  # conv_x_proj's channels a program
    ssm_block: tuple[int, int]  # ssm_step's channels a program, warps
    out_proj: tuple[int, int, int, int]  # BN, BK, warps, programs to aim for by splitting K
    in_proj: tuple[int, int, int, int]  # BN, BK, warps, pipeline stages
    lm_head: tuple[int, int, int, int]  # BN, BK, warps, pipeline stages
    in_proj_sum_last: bool  # a row's products summed over K once, after the loop (not every tile)
    lm_head_sum_last: bool
    in_proj_unroll: int  # the K loop unrolled by this much where summed after it
    early_launch: frozenset  # kernels that let the next launch before their own wait (PDL 2)
    ssd_block: int  # Mamba-2's ssd_conv_step: a head's channels a program (all N states of each in registers)
    router: tuple[int, int, int, int]  # a mixture of experts' router product (float32 weights): BN, BK, warps, stages
    moe_in: tuple[int, int, int] | None = None  # its gate and up products: BN, BK, warps (None: in_proj's)
    moe_out: tuple[int, int, int, int] | None = None  # its down products: BN, BK, warps, programs (None: out_proj's)
    # 16-bit and FP8 weights: in_proj's products on the tensor cores (kernels/gemv.mma_terms),
    # and out_proj's (Mamba-2's gated_out_proj); float32 weights keep the multiply-and-sum
    in_proj_mma: bool = False
    out_proj_mma: bool = False


def one_row_blocks(d_model: int, d_inner: int, vocab: int, dtype: torch.dtype, layer: str = "mamba1") -> OneRowBlocks:
    """The one-row step's settings for a model's shapes (and its layer kind, core/layers.LAYER_KINDS),
    each chosen by timing whole graph-replayed batch-1 steps (benchmarks/tune_decode.py
    --in-graph and its sweeps; Mamba-2's in_proj: benchmarks/mamba2.py --in-proj-tiles)."""
    wide, sixteen_bit = d_model > 1024, dtype != torch.float32

    def linear(n_out: int) -> tuple[int, int, int, int]:
        # 16 rows a program (2.8b in_proj: 2.72 ms a step against 2.82 with 32), 8 for
        # 1.4b's in_proj (1.120 against 1.140); up to 1024 of K in one tile, all of it loaded
        # before the PDL wait; wider in_proj walks K in tiles of 256, wider lm_head 512
        in_proj = n_out == 4 * d_model
        BN = 8 if 1024 < d_model <= 2048 and in_proj else 16
        return BN, 1024 if d_model <= 1024 else (256 if in_proj else 512), 4, 1

    head = linear(vocab)
    in_proj = linear(2 * d_inner)
    if layer == "mamba2" and 2048 < d_model <= 2560:
        # Mamba-2's in_proj has 2E + 2GN + H rows: at 2.7b's width, 661 programs of 16, one
        # more than run at once (132 SMs x 5 programs); 32 rows a program: 1.967 ms a step
        # against 2.269. Codestral's width keeps 16 (4.059 against 4.251 at 32), 130m too.
        in_proj = (32, *in_proj[1:])
    return OneRowBlocks(
        # in in_proj the extra latency outweighs the saved boundary once the product is
        # long (2.8b 2.19 ms a step in in_proj against 2.01 on their own; 130m 0.232 / 0.282)
        conv_in_in_proj=not wide,
        # few programs queue fewer atomic adds at x_proj's outputs (2.8b 1.798 ms at 128
        # channels against 1.954 at 32)
        conv_block=128,
        # one warp a program: the chain after the wait runs in one warp's registers and
        # shuffles, no barrier between warps (2.8b 1.7045 ms against 1.7410 at 16 and 4)
        ssm_block=(8 if wide else 4, 1),
        # K split so that ~1280 / 640 programs load a first tile before their wait (1.4b
        # 1.137 against 1.140 with 32-row tiles)
        out_proj=(8, 256, 4, 1280) if wide else (8, 512, 4, 640),
        in_proj=in_proj,
        # 16-bit lm_head summed after its loop walks K in 256-wide tiles (2.8b 1.7631 against 1.7660)
        lm_head=(head[0], 256 if sixteen_bit else head[1], head[2], head[3]),
        # summed after the loop for 16-bit weights (2.8b 1.773 against 1.800); float32's
        # every tile (3.152 against 3.280)
        in_proj_sum_last=sixteen_bit,
        lm_head_sum_last=sixteen_bit,
        # two tiles' loads in flight a thread (2.8b 1.7492 against 1.7680 unrolled by one)
        in_proj_unroll=2,
        # ssm_step and out_proj (and conv_x_proj where it runs) let the next kernel load its
        # first weights sooner (1.4b 1.344 against 1.394)
        early_launch=frozenset({"conv_x_proj", "ssm_step", "out_proj_residual"}),
        # 16 channels, as the layer-ops step's update kernel (SSD_TILES.step_bp); not swept here
        ssd_block=16,
        # 2 experts' rows a program, the whole row in one tile loaded before the PDL wait, where
        # in_proj's 8 x 256 walked Granite-4.0-H-Tiny's 64 x 1536 in 8 programs, 6 tiles each
        # (its batch 1: 1.826 / 1.861 ms against 1.968 / 2.000, H100; other splits not tried)
        router=(2, min(4096, 1 << (d_model - 1).bit_length()), 4, 1),
    )


@dataclass(frozen=True)
class ProductsBlocks:
    """The products step's element-wise kernels that stream the state (kernels/decode_gemm.py's
    conv_step and ssm_update): (channels a program, warps) each. Like OneRowBlocks, never
    chosen by the batch size."""

    conv_step: tuple[int, int]
    ssm_update: tuple[int, int]


# 128 channels in 4 warps (2.8b batch 128, whole steps: ssm_update 5.99 ms a step against
# 6.15 at 64 channels, other shapes no better; conv_step within 0.3% from 64 to 256 channels)
PRODUCTS_BLOCKS = ProductsBlocks(conv_step=(128, 4), ssm_update=(128, 4))


@dataclass(frozen=True)
class DecodePlan:
    step: str  # "one-row" or "products" (see above)
    cublas: frozenset = NONE  # the products step's projections through cuBLAS; the rest through invariant_gemm
    splits: tuple = SPLITS  # (projection, K chunks) for the Triton products
    # The products whose 16-bit operand enters as two 16-bit halves (kernels/split16.py,
    # ~16 bits kept, the product twice as tall) instead of rounded once to the storage
    # dtype. None by default: docs/architecture.md's contract rounds a 16-bit product's
    # operand once, as transformers' and mamba_ssm's 16-bit paths do, and the halves cost
    # time where the products are tall (2.8b batch 128, in_proj: 23.3 µs of an 87 µs layer).
    halves: frozenset = NONE
    pdl: bool = True  # programmatic dependent launch between the step's kernels (Hopper and newer)
    blocks: OneRowBlocks | None = None  # the one-row step's settings (None: one_row_blocks's)
    reason: str = ""
    products_blocks: ProductsBlocks = PRODUCTS_BLOCKS  # the products step's element-wise kernels'

    def __post_init__(self):
        if self.step not in ("one-row", "products", "layer-ops"):
            raise ValueError(f"DecodePlan.step must be 'one-row', 'products' or 'layer-ops', got {self.step!r}")
        for field in ("cublas", "halves"):
            if not getattr(self, field) <= ALL:
                raise ValueError(f"DecodePlan.{field}: unknown projections {sorted(getattr(self, field) - ALL)}")

    @property
    def family(self) -> str:
        """The one-row and the all-Triton ("triton products") families each give a slot the
        same bits at any batch size; a plan with cuBLAS products ("cublas") may not."""
        if self.step == "one-row":
            return "one-row"
        return "triton products" if not self.cublas else "cublas"


@dataclass(frozen=True)
class Route:
    weights: str  # "16-bit" (bfloat16, float16), "float32" or "fp8" (float8 e4m3 with a scale a row)
    widths: tuple[int, int]  # d_model, from and to
    batches: tuple[int, int]  # batch sizes, from and to
    step: str
    cublas: frozenset
    reason: str


# PDL chains Triton kernels (deterministic step, 2.8b bf16, batch 1: 2.575 ms a step
# against 2.904 without); between cuBLAS products it lost (batch 128: 6.057 against 5.984),
# so a plan with every product on cuBLAS runs without it.
ROUTES = (
    # -- 16-bit weights ----------------------------------------------------------------------
    Route("16-bit", (1, 768), (1, 4), "one-row", NONE,
          "GEMVs a row a program win while the rows' L2 traffic is small (130m batch 4: 0.409 ms against 0.446)"),
    Route("16-bit", (769, 1024), (1, 3), "one-row", NONE, "the crossover falls as the model widens (370m batch 4 loses: 1.011 / 0.924)"),
    Route("16-bit", (1025, MANY), (1, 2), "one-row", NONE, "(2.8b batch 2: 2.355 against 2.479; 1.4b batch 3 loses: 1.806 / 1.490)"),
    Route("16-bit", (1, 768), (5, 32), "products", NONE, "each weight read once for all rows, Triton GEMM's small tiles"),
    Route("16-bit", (769, 1024), (4, 32), "products", NONE, "as above"),
    Route("16-bit", (1025, MANY), (3, 32), "products", NONE, "(2.8b batch 32: 3.445 ms against cuBLAS 3.965)"),
    Route("16-bit", (1, 1024), (33, 256), "products", IN_PROJ,
          "above 32 rows the Triton in_proj's 64-row tiles read at 1.3 TB/s: cuBLAS's wins (130m 128: 0.860 / 0.910)"),
    Route("16-bit", (1025, MANY), (33, 128), "products", IN_PROJ, "(2.8b batch 64: 4.280 against 4.602 all Triton)"),
    Route("16-bit", (1, 1024), (257, MANY), "products", ALL, "cuBLAS's large tiles"),
    Route("16-bit", (1025, MANY), (129, MANY), "products", ALL, "(2.8b batch 256: 9.640 against 10.165)"),
    # -- float32 weights (the Triton products in three TF32 passes, tf32x3) -----------------------
    Route("float32", (1, 1024), (1, 8), "one-row", NONE, "(130m batch 8: 0.803 ms against cuBLAS 1.183)"),
    Route("float32", (1025, MANY), (1, 3), "one-row", NONE, "(2.8b batch 3: 5.514 against 9.329; batch 4 loses: 7.396 / 6.311)"),
    Route("float32", (1025, MANY), (4, 6), "products", IN_PROJ, "cuBLAS picks a GEMV-like in_proj here (1.4b batch 4: 3.442 / 3.699)"),
    Route("float32", (1025, MANY), (7, 16), "products", NONE, "(1.4b batch 16: 4.050 against 5.307 with cuBLAS's in_proj)"),
    Route("float32", (1, 1024), (9, 32), "products", NONE, "16-row tf32x3 tiles"),
    Route("float32", (1025, MANY), (17, 64), "products", IN_PROJ,
          "the 16-row tiles read in_proj's weights again each 16 rows (2.8b batch 32: 9.498 / 10.605)"),
    Route("float32", (1, 1024), (33, 64), "products", IN_PROJ, "64-row tf32x3 tiles run partly empty (130m batch 64: 1.296 / 1.381)"),
    # cuBLAS's float32 products run on the CUDA cores; tf32x3 on the tensor cores wins at every
    # larger batch measured (backbone 128 x 3 batch 1024: 0.119 ms against 0.169, 4096: 0.320 / 0.364)
    Route("float32", (1, 2048), (65, MANY), "products", NONE,
          "(1.4b batch 128: 8.962 against cuBLAS 11.372, 512: 32.55 / 35.06; 130m 1024: 7.16 / 8.82)"),
    Route("float32", (2049, MANY), (65, MANY), "products", NONE, "(2.8b batch 128: 18.111 against 20.804, 256: 33.15 / 37.07)"),
    # -- FP8 weights -----------------------------------------------------------------------------------
    # The one-row kernels and the Triton products read the e4m3 bytes themselves (kernels/fp8_gemm.py:
    # bfloat16 operands, the values widened exactly); a product on "cuBLAS" is cuBLASLt's FP8 GEMM
    # with the activations quantized a row (fp8_linear). The one-row crossovers and the widths up
    # to 1024 are 16-bit's, untuned; past 1024 `benchmarks/decode_routing.py --models 2.8b --dtypes
    # fp8`, H100 80GB HBM3, 2026-12-07, trees of 911838a and 089be5f, ms a step.
    Route("fp8", (1, 768), (1, 4), "one-row", NONE, "untuned: 16-bit's crossover"),
    Route("fp8", (769, 1024), (1, 3), "one-row", NONE, "untuned: 16-bit's crossover"),
    Route("fp8", (1025, MANY), (1, 2), "one-row", NONE, "untuned: 16-bit's crossover"),
    Route("fp8", (1, 768), (5, MANY), "products", NONE, "untuned: the Triton products read the e4m3 bytes"),
    Route("fp8", (769, 1024), (4, MANY), "products", NONE, "untuned: as above"),
    Route("fp8", (1025, MANY), (3, 64), "products", NONE,
          "(2.8b, H100: batch 32 4.019 ms against 4.149 with cuBLASLt's in_proj and 6.157 all cuBLASLt; 64: 4.634 / "
          "4.796 / 6.765)"),
    Route("fp8", (1025, MANY), (65, MANY), "products", IN_OUT_PROJ,
          "in_proj and out_proj on cuBLASLt's FP8 GEMM, the activations quantized a row (2.8b batch 128, 089be5f: "
          "7.122 against 7.487 in_proj alone, 8.564 all Triton; 911838a: 8.399 all cuBLASLt, whose small products "
          "lose the quantize pass)"),
)
DETERMINISTIC = Route("any", (1, MANY), (1, MANY), "products", NONE,
                      "deterministic=True: the batch-invariant Triton products at every batch size")


def _weights(dtype: torch.dtype) -> str:
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    return "float32" if dtype == torch.float32 else "16-bit"


def route_for(d_model: int, dtype: torch.dtype, batch: int, deterministic: bool = False) -> Route:
    """The table's entry for this width, weight dtype, batch size and mode."""
    if deterministic:
        return DETERMINISTIC
    r = _entry(ROUTES, d_model, dtype, batch)
    if r is None:
        raise ValueError(f"no decode route for d_model {d_model}, {dtype}, batch {batch}")
    return r


def _entry(table, d_model: int, dtype: torch.dtype, batch: int) -> Route | None:
    w = _weights(dtype)
    return next((r for r in table if r.weights == w and r.widths[0] <= d_model <= r.widths[1]
                 and r.batches[0] <= batch <= r.batches[1]), None)


# Mamba-2 layers: the one-row step (kernels/decode_step_mamba2.py) at the few rows where it
# wins, otherwise the layer over the GPU ops with cuBLAS's products (or, deterministic,
# invariant_gemm's at every batch size, as for Mamba-1). `benchmarks/decode_routing.py`, H200
# bf16, ms a step: one-row / cuBLAS / Triton products (2.7b batch 128: 14.76 / 16.33). A
# bf16 state (opt-in) saves 1.5-1.6x at batch 128 and nothing at batch 1:
# benchmarks/RESULTS.md, "Mamba-2". float32 weights were not measured: they take the layer
# over the GPU ops.
MAMBA2_ROUTES = (
    Route("16-bit", (1, 1024), (1, 4), "one-row", NONE,
          "Mamba-2 (130m batch 4: 0.420 against 0.611; batch 8 loses: 0.735 / 0.651)"),
    Route("16-bit", (1025, MANY), (1, 1), "one-row", NONE,
          "Mamba-2 (2.7b batch 1: 1.967 against 2.815, Codestral 4.059 / 5.211; batch 2: 2.880 / 2.963, "
          "Codestral loses, 6.278 / 5.393)"),
)
LAYER_OPS = DecodePlan("layer-ops", cublas=ALL, pdl=False,
                       reason="Mamba-2: the layer over the GPU ops, cuBLAS products "
                       "(2.7b batch 128: 14.76 ms against 16.33)")
LAYER_OPS_DETERMINISTIC = DecodePlan("layer-ops", pdl=False, reason="Mamba-2, deterministic: invariant_gemm's products")


# Hybrids (Nemotron-H, Granite-4.0-H, Falcon-H1, Bamba): the one-row step
# (kernels/decode_step_hybrid.py) where a row of its table says so and the model's sublayers
# are all of its kinds, else their layers over the GPU ops, cuBLAS's products. One table
# for the dense ones, one for those with experts, whose one-row step reads only the rows'
# picks and wins at more rows. `benchmarks/hybrid.py --plans layer-ops,one-row`, H100, bf16
# weights and state, 1k-token contexts, ms a step, one-row / layers (benchmarks/RESULTS.md,
# "Hybrid models"). FP8 weights take 16-bit's rows, UNTUNED (the one-row kernels read the e4m3
# bytes and pass their tests on an H100; not timed against the layers' cuBLASLt FP8 products);
# float32 weights were not timed: the layers over the GPU ops.
def _and_fp8(rows: tuple[Route, ...]) -> tuple[Route, ...]:
    return rows + tuple(replace(r, weights="fp8", reason=f"untuned: 16-bit's row, {r.reason}") for r in rows)


HYBRID_ROUTES: tuple[Route, ...] = _and_fp8((
    Route("16-bit", (1, 2048), (1, 2), "one-row", NONE,
          "hybrids (Granite-4.0-H-Micro batch 1: 2.733 / 3.569, batch 2: 3.274 / 3.530; batch 4 loses: 5.219 / 3.622)"),
    Route("16-bit", (2049, MANY), (1, 1), "one-row", NONE,
          "hybrids (batch 1: Nemotron-H-8B 5.656 / 6.192, Falcon-H1-7B 6.178 / 7.692; Nemotron-H-8B batch 2 "
          "loses: 6.783 / 6.197)"),
))
HYBRID_MOE_ROUTES: tuple[Route, ...] = _and_fp8((
    Route("16-bit", (1, MANY), (1, 4), "one-row", NONE,
          "hybrids with experts (Granite-4.0-H-Tiny batch 1: 1.934 / 3.461, 2: 2.461 / 3.887, 4: 3.748 / 4.410; "
          "batch 8 loses: 5.890 / 5.561)"),
))


def plan_for(config, dtype: torch.dtype, batch: int, deterministic: bool = False) -> DecodePlan:
    """The decode plan for a model of this config, weights of `dtype` (the large matrices':
    MambaWeights.dtype, float8_e4m3fn for FP8 weights), `batch` rows."""
    if getattr(config, "hybrid", False):
        if deterministic:
            return LAYER_OPS_DETERMINISTIC
        r = _entry(HYBRID_MOE_ROUTES if "moe" in config.kinds else HYBRID_ROUTES, config.d_model, dtype, batch)
        if r is None or not set(config.kinds) <= set(ONE_ROW_KINDS):
            return LAYER_OPS
        return DecodePlan(step=r.step, blocks=one_row_blocks(config.d_model, config.d_inner, config.vocab_size, dtype,
                                                             config.layer), reason=r.reason)
    if config.layer == "mamba2":
        if deterministic:
            return LAYER_OPS_DETERMINISTIC
        # FP8 weights (UNTUNED): 16-bit's rows, past them the layer over the GPU ops, whose
        # products are kernels/fp8_gemm.fp8_linear (cuBLASLt's FP8 GEMM)
        fp8 = dtype == torch.float8_e4m3fn
        r = _entry(MAMBA2_ROUTES, config.d_model, torch.bfloat16 if fp8 else dtype, batch)
        if r is None:
            return LAYER_OPS
        if fp8:
            r = Route("fp8", r.widths, r.batches, r.step, r.cublas, f"untuned: 16-bit's row, {r.reason}")
    else:
        r = route_for(config.d_model, dtype, batch, deterministic)
    blocks = (one_row_blocks(config.d_model, config.d_inner, config.vocab_size, dtype, config.layer)
              if r.step == "one-row" else None)
    return DecodePlan(step=r.step, cublas=r.cublas, pdl=r.cublas != ALL, blocks=blocks, reason=r.reason)


def batch_invariant_ranges(d_model: int, dtype: torch.dtype, up_to: int = 512) -> list[tuple[int, int, str]]:
    """(first, last, family) batch ranges, up to `up_to`, within which the default plan gives
    a slot the same bits at every batch size (the one-row step, or the all-Triton products)."""
    out: list[list] = []
    for b in range(1, up_to + 1):
        r = route_for(d_model, dtype, b)
        family = DecodePlan(r.step, r.cublas).family
        if out and out[-1][2] == family and out[-1][1] == b - 1:
            out[-1][1] = b
        else:
            out.append([b, b, family])
    return [tuple(x) for x in out if x[2] != "cublas"]


# == The Backbone's step ======================================================================
# fastmamba.Backbone's step on CUDA (engine/backbone_step.py): the lockstep step
# (kernels/lockstep_step.py: the whole step one launch, its programs in lockstep through
# grid barriers) where a row here says so and the grid fits the GPU at once, else (and in the
# deterministic mode, and for Mamba-2 layers) the decode kernels' step (KernelStep) by the
# decode plan above.
@dataclass(frozen=True)
class LockstepRoute:
    widths: tuple[int, int]  # d_model, from and to
    batches: tuple[int, int]  # batch sizes, from and to
    rows: int  # rows a group (below 16: multiply-and-sum products; 16: the tensor cores)
    channels: int  # each program's slice of d_inner
    warps: int
    reason: str
    weights: str = "any"  # the large matrices' dtype: "16-bit", "float32" or "any"


# Its two shapes, for the batches each can serve: what `benchmarks.backbone --steps lockstep`
# times against the decode kernels' step, and what the tests run.
LOCKSTEP_SHAPES = (
    LockstepRoute((1, 256), (1, 8), rows=1, channels=16, warps=4,
                  reason="a row a group, E / 16 programs each (128 x 3: 16; 122 registers, no spill at bf16)"),
    LockstepRoute((1, 256), (9, 256), rows=16, channels=32, warps=8,
                  reason="16 rows a group on the tensor cores (128 x 3: 8 programs a group, 128 at batch 256; "
                         "bf16 255 registers, no spill at 8 warps, 472 bytes spilled at 4; float32's tf32x3 "
                         "products spill 208 bytes at 8 warps)"),
)
# Where the step takes it: the batches where it beat the decode kernels' step.
# `python -m benchmarks.backbone --step-only --shapes 128x3 --steps kernels,lockstep`, H100
# 80GB HBM3, 2026-12-07, tree of 911838a, graph replays in µs, decode kernels / lockstep
# (benchmarks/RESULTS.md, "The recurrent backbone"). Timed at d_model 128 only.
LOCKSTEP_ROUTES: tuple[LockstepRoute, ...] = (
    replace(LOCKSTEP_SHAPES[0], batches=(4, 8), weights="16-bit",
            reason="where 16-bit weights take the products step (bf16 batch 4: 25.0 / 23.6, 5: 39.9 / 23.8, 8: 39.7 / "
                   "23.9; batch 2 loses: 23.4 / 23.9; float32's one-row step wins at 1-8: 19.5-23.2 / 23.4-24.0)"),
    replace(LOCKSTEP_SHAPES[1], batches=(64, 256),
            reason="(float32 batch 64: 67.4 / 58.0, 128: 75.0 / 60.0, 256: 77.3 / 69.3; bf16 49.1 / 46.2, 53.9 / 48.5, "
                   "58.8 / 49.8; batch 32 loses: 52.4 / 58.7 and 41.3 / 46.2, batch 16 45.6 / 39.9 bf16)"),
)


def lockstep_route(config, dtype: torch.dtype, batch: int, deterministic: bool, multiprocessors: int,
                   routes: tuple[LockstepRoute, ...] | None = None) -> LockstepRoute | None:
    """The row of `routes` (None: LOCKSTEP_ROUTES) for this Backbone config (BackboneConfig),
    large matrices' dtype and batch, or None: the decode kernels' step. None too where the
    grid would not fit the GPU's `multiprocessors` at once (the barriers wait for every
    program of a group) or the widths do not fit."""
    if deterministic or config.layer != "mamba1":
        return None
    w = _weights(dtype)
    r = next((r for r in (LOCKSTEP_ROUTES if routes is None else routes) if r.widths[0] <= config.d_model <= r.widths[1]
              and r.batches[0] <= batch <= r.batches[1] and r.weights in ("any", w)), None)
    if r is None or config.d_inner % r.channels:
        return None
    programs = config.d_inner // r.channels
    if -(-batch // r.rows) * programs > multiprocessors or unfit(config, dtype, r.rows, programs):
        return None
    return r


# A Mamba-2 Backbone's step (engine/backbone_ops.step_ops: its layers over the GPU ops, in a CUDA
# graph): "layer-ops" with its products through cuBLAS, or through invariant_gemm (float32
# weights in three TF32 passes, as the Mamba-1 Backbone's step). `python -m benchmarks.backbone
# --step-only --layer mamba2 --shapes 128x3 [--deterministic]` (the Triton products), H100 80GB
# HBM3, 2026-12-07, tree of 3c75f4d, graph replays, µs, cuBLAS / Triton. Past 256 rows not
# timed: cuBLAS there, as before.
BACKBONE_MAMBA2_ROUTES = (
    Route("float32", (1, MANY), (1, 1), "layer-ops", ALL, "(batch 1: 46.7 µs against 54.9)"),
    Route("float32", (1, MANY), (2, 256), "layer-ops", NONE,
          "cuBLAS's float32 kernel at 16 rows took 52 and 25 µs a layer (batch 16: 56.7 µs against 277.1, 256: "
          "123.5 / 143.0)"),
    Route("16-bit", (1, MANY), (1, 256), "layer-ops", NONE,
          "(batch 1: 46.1 µs against 50.0, 16: 48.7 / 55.5, 256: 107.4 / 111.1)"),
)


def backbone_step_plan(config, dtype: torch.dtype, batch: int, deterministic: bool) -> DecodePlan:
    """A Mamba-2 Backbone's step (BackboneConfig `config`, the large matrices' dtype): the
    layer over the GPU ops with the products BACKBONE_MAMBA2_ROUTES names (cuBLAS past it;
    deterministic: invariant_gemm's at every batch)."""
    if deterministic:
        return LAYER_OPS_DETERMINISTIC
    r = _entry(BACKBONE_MAMBA2_ROUTES, config.d_model, dtype, batch)
    return LAYER_OPS if r is None else DecodePlan(r.step, r.cublas, pdl=False, reason=r.reason)


# == The prefill, Mamba-2 scan, training and sampler kernels' tiles ===========================
# One instance of each kernel module's settings type, each value with its reason; the GPU ops
# (core/ops.triton_ops, training_ops) bind them from KERNEL_TILES, the samplers
# (core/sampling.pick_sampler) take SAMPLER_TILES. Measured on the H200 by the sweeps
# named; their tables: benchmarks/RESULTS.md.

# -- the prefill conv (kernels/causal_conv1d.py; benchmarks/tune_conv.py, 2.8b widths, bf16) --
# A program walks its steps with the last inputs in registers, its loads pipelined so that
# several rows of x are in flight a thread (1 x 8192: 55.4 µs against 70.5 for the plain
# loop, 128 channels and 8 steps); outputs bitwise the same.
CONV_TILES = ConvTiles(
    be=256,  # 4 channels a thread
    bt=32,
    warps=2,
    stages=3,
    unroll=4,
)

# -- the step sizes' GEMM (kernels/step_size.py; benchmarks/tune_step_size.py, 2.8b widths) --
# The sweep's best: 60.6 µs at 4096 tokens; its two exps an element are most of the gap to
# cuBLAS's dt_proj alone, which writes no softplus.
STEP_SIZE_TILES = StepSizeTiles(
    bm=64,
    bn=128,
    bk=32,  # (not swept: dt_rank is 48-160 at the public sizes)
    warps=4,
    stages=3,
)

# -- the Mamba-1 prefill scan (kernels/selective_scan.py; benchmarks/tune_scan.py) --------------
SCAN_TILES = ScanTiles(
    # below both the one-pass scan's few launches win; above, its one program a row and 8
    # channels walks too long (16 x 256 x 5120: 490.8 µs one-pass, 170.4 chunked)
    chunked_from=1024,
    chunked_work=1 << 21,
    # half-length chunks where full ones leave the GPU short of programs (2.8b 1 x 4096, 1280
    # programs: 375 µs against 440 with 128-step chunks); from 1536 up 128 steps win
    chunk=128,
    few_programs=1536,
    # 4 channels a thread, one warp a program: each step's loads of B and C serve 64 states
    be=128,
    warps=1,
    stages=4,
    unroll=2,  # (1 x 4096: 317 µs against 340 with 1)
    # one chunk (no summaries: each exp once) where the rows' channels give 768 warps of one
    # channel a thread (2.8b 8 x 2048: 740.7 µs against 963.8 with 4 a thread in 128-step chunks)
    one_chunk_lanes=24576,
    # one channel a thread where 4 a thread leave the GPU too few warps (130m 2 x 1024: 58.6
    # µs against 78.2); from ~16M channel-steps on they tie or lose
    small_work=12 << 20,
    lane_stages=3,  # (2.8b 8 x 2048, one chunk: 733 µs against 875 with 2 stages)
    lane_unroll=4,
    # the pass between the two walks one step a chunk: many small programs
    prefix_be=32,
    prefix_warps=4,
    # (2.8b 16 x 1024: 760.6 µs against 808.9 with the step sizes made first); at 130m's
    # dt_rank 48 the step-size kernel's product is small and it loses
    softplus_from_rank=128,
    step_size=STEP_SIZE_TILES,
)

# -- the Mamba-2 scan (kernels/ssd.py) ---------------------------------------------------------
SSD_TILES = SSDTiles(
    # the per-chunk states (H x P x N float32 each) are the chunked SSD's memory traffic:
    # fewer, longer chunks move less
    chunk=256,
    # the chunk scan (benchmarks/tune_ssd_scan.py): 32-step blocks, the best at every public
    # shape (2.7b 1 x 8192: the whole scan 0.428 ms a layer against 0.480 with 64-step blocks)
    bt=64,
    bs=32,
    scan_warps=4,
    scan_stages=3,  # (Triton's default)
    state_bp=64,  # (not swept)
    # the state passing (benchmarks/tune_ssd_pass.py): many chunks a load, the recurrence over
    # them an associative scan (2.7b 1 x 8192: 54 µs a layer against 263 one chunk a load)
    pass_bl=512,
    pass_cb=8,
    pass_warps=4,
    sizes_bh=16,  # (not swept)
    # C B^T once a group in a kernel of its own is slower than each head's program making it
    # (2.7b's scan 0.853 ms against 0.820, `benchmarks/mamba2.py --scan-kernels`)
    cb_once=False,
    # the decode step's update (benchmarks/tune_ssd_step.py): one warp, faster with a bf16
    # state at the large shapes and the same with float32 (2.7b batch 128, bf16 state: 85.5 µs
    # a layer against 95.6 with 4 warps)
    step_bp=16,
    step_warps=1,
)

# -- training (kernels/scan_grad.py, kernels/conv_grad.py; fastmamba.Backbone under autograd) --
# The scan's (benchmarks/tune_train_scan.py, forward + backward): the backward holds some ten
# (BT, BE, N) tiles at once, so small tiles in 2 warps win (16 x 1024 x 256: 1.26 ms against
# 1.58 at 32 steps, 8 channels, 4 warps).
TRAIN_SCAN_TILES = TrainScanTiles(bt=16, be=8, warps=2)
# The CPU's (step_and_scan_train_ref): chunks of states within ~1 MB, a core's L2 (RESULTS "POPGym").
CPU_SCAN_CHUNK_ELEMENTS = 1 << 18
# The conv's backward (not swept; at 128 x 3's layer, 16 x 1024, the conv's forward and
# backward take 0.78 ms); its forward is the prefill conv's kernel.
CONV_GRAD_TILES = ConvGradTiles(forward=CONV_TILES, be=64, bt=32, warps=4)
# The Mamba-2 Backbone's training SSD (kernels/ssd_grad.py): 64-step chunks, the backward's
# (Q, Q) and (Q, N) tiles in one program's registers at N = 128 (chunks of 64, 32 and 16 and
# 4 and 8 warps tried on an H100: 64 and 4 kept; it still spills at P 64, N 128)
SSD_GRAD_TILES = SSDGradTiles(chunk=64, warps=4)

# -- a hybrid's decode attention (kernels/paged_attention.py) ---------------------------------
# A row's tokens dealt over 128 programs, its key/value heads' splits, in runs of 64 (each
# split every splits-th run): at batch 1 about one program an SM of an H100 over a long
# context, whatever the heads (Nemotron-H-8B's 8: 16 splits; Falcon-H1-7B's 2: 64). A fixed 16
# splits a head read Falcon-H1-7B's 16k-token context at a sixth of the copy rate: its batch 1
# took 7.372 ms a step against 6.392, batch 128 at 1k 2% slower (18.62 / 18.99; H100, RESULTS
# "Hybrid models"). The combine takes a program a query head and its splits at once (a serial
# loop over 64 splits kept the step at 7.43 ms), and a split with no run returns at once. The
# count UNTUNED (`python -m benchmarks.tune_paged` times several at the public shapes' heads).
# 64 tokens: the products' tiles on the tensor cores at 114 registers (sm_90 compile), not
# swept; 8 splits of the table's columns on the CUDA cores took 936 µs a sublayer at batch 128.
PAGED_TILES = PagedTiles(programs=128, warps=4, tokens=64)

# -- a mixture of experts' grouped products (kernels/moe.py) -----------------------------------
# By the launch's tokens (MoELaunch; the deterministic decode step takes `few` at every batch).
# `python -m benchmarks.tune_moe`, H100 80GB HBM3, 2026-12-07, tree of 089be5f, µs a sublayer's
# grouped products (uniform routing; the earlier untuned tiles, 64 x 64 x 64, 4 warps, in brackets):
# - 64 tokens, Granite-4.0-H-Tiny's experts: 16 x 64 x 64, 4 warps, 319.2 (395.0), the best of 24;
#   Nemotron 3 Nano's: the best five, all 16-row, 972.9-977.7 (984.5).
# - 8192 tokens: 64 x 128 x 64, 4 warps, the best at both: Tiny 1077.9 (1258.4), Nano 3829.5 (5634.7).
# Not measured between 64 and 8192: `many` from 1024 tokens, where each of Tiny's 64 experts
# has ~96 pairs on average (6 a token), past a 64-row block (at 64 tokens, 6).
# align_pairs, align_chunk UNTUNED: one program groups a decode step's pairs (6 experts a token:
# up to 42 tokens), its P^2 compares small to here; past it, programs of 256 pairs (two launches).
MOE_TILES = MoELaunch(few=MoETiles(bm=16, bn=64, bk=64, warps=4, stages=3, align_pairs=256, align_chunk=256),
                      many=MoETiles(bm=64, bn=128, bk=64, warps=4, stages=3, align_pairs=256, align_chunk=256),
                      many_from=1024)

KERNEL_TILES = KernelTiles(conv=CONV_TILES, scan=SCAN_TILES, ssd=SSD_TILES, conv_grad=CONV_GRAD_TILES,
                           train_scan=TRAIN_SCAN_TILES, paged=PAGED_TILES, moe=MOE_TILES)

# -- the samplers (kernels/sampler.py) ---------------------------------------------------------
# The filters' search: counting passes spread over the row's programs narrow a band of keys to
# at most `cap` tokens, which one program sorts (batch 1, top-p: 42.6 µs a step against 267
# with sampling.sample's sort of the vocabulary).
SAMPLER_TILES = SamplerTiles(
    bv=1024,  # (50 programs a row at the public vocabularies)
    nb=8,  # thresholds a pass (the band's range cut in 8 slices)
    cap=1024,  # the sort at the end holds this many keys in one program's registers
    rounds=4,  # bands still over `cap` after 4 passes are rare (very flat or tie-heavy rows)
)

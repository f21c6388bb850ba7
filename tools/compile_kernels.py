"""Compiles every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

Triton ships ptxas, so compile errors (types, layouts, unsupported ops) show up here, in CI,
rather than on the lent GPU. It checks that the kernels build, not that they are right
(tests/test_kernels.py) or fast (benchmarks/), and prints each kernel's registers, spills
(STACK: bytes a thread of registers spilled to local memory; LOCAL stays 0 for them) and
shared memory from the cubin (Triton's cuobjdump), which costs no device time.
With --loops it also prints, for each loop of each kernel's SASS, how many instructions
of the kinds that bound these kernels it runs an iteration: special-function (MUFU) and
float32 ones, loads and stores by space, barriers, shuffles, spill traffic (LDL / STL).
Layout conversions inside a loop show up there as shared-memory stores, loads and barriers.
With --conversions it lists each kernel's layout conversions (Triton GPU IR) with the
source lines they come from: how the prefill conv's per-tap conversions were found. With
--mix it prints the whole kernel's instruction mix (code outside loops too: how the step-size
kernel's softplus epilogue was found to be most of its instructions).
The GPU machine's Triton may be older than this one's, and the code each version makes
differs: for SASS that matches the GPU's, run it with that version (a virtual environment
with --system-site-packages and `pip install triton==<its version>`).
Run it without TRITON_INTERPRET:

    python tools/compile_kernels.py [--loops] [--conversions] [--mix]
"""
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastmamba.engine.plan import (  # noqa: E402
    CONV_GRAD_TILES,
    CONV_TILES,
    LOCKSTEP_SHAPES,
    MOE_TILES,
    PAGED_TILES,
    PRODUCTS_BLOCKS,
    SAMPLER_TILES,
    SCAN_TILES,
    SSD_TILES,
    STEP_SIZE_TILES,
    TRAIN_SCAN_TILES,
    one_row_blocks,
)
from fastmamba.kernels import causal_conv1d as cc  # noqa: E402
from fastmamba.kernels import conv_grad as cg  # noqa: E402
from fastmamba.kernels import decode_gemm as dg  # noqa: E402
from fastmamba.kernels import decode_step as ds  # noqa: E402
from fastmamba.kernels import decode_step_hybrid as hy  # noqa: E402
from fastmamba.kernels import decode_step_mamba2 as s2  # noqa: E402
from fastmamba.kernels import fp8_gemm as f8  # noqa: E402
from fastmamba.kernels import gated_norm as gn  # noqa: E402
from fastmamba.kernels import lockstep_step as ls  # noqa: E402
from fastmamba.kernels import moe as mo  # noqa: E402
from fastmamba.kernels import paged_attention as pa  # noqa: E402
from fastmamba.kernels import products as gm  # noqa: E402
from fastmamba.kernels import rmsnorm as rn  # noqa: E402
from fastmamba.kernels import sampler as sp  # noqa: E402
from fastmamba.kernels import scan_grad as sg  # noqa: E402
from fastmamba.kernels import selective_scan as ss  # noqa: E402
from fastmamba.kernels import ssd as sd  # noqa: E402
from fastmamba.kernels import step_size as st  # noqa: E402

target = GPUTarget("cuda", 90, 32)


# Integer arguments that are 1 at every launch (the unit strides of the prefill kernels'
# strided views: channels contiguous). Triton's launcher compiles an integer argument of
# value 1 as the constant 1, which lets loads along it vectorise; compiled as plain
# integers here they would not, and the code would not be the code that runs.
UNIT_STRIDES = ("sxe", "sde", "sbn", "scn", "sze", "srk")
# Integer arguments the launcher leaves unspecialised (do_not_specialize): no alignment
# is known of them (the scan's `zero`, see selective_scan._lane_zero).
UNALIGNED = ("zero",)


def compile_kernel(jitfn, types, constexprs, num_warps=4, **options):
    """Compiles one kernel (arguments not named in `types` are int32 scalars, but for
    UNIT_STRIDES, the constant 1) with the launch's other options (enable_fp_fusion) and
    prints its resource usage."""
    names = jitfn.arg_names
    constexprs = {**{n: 1 for n in names if n in UNIT_STRIDES}, **constexprs}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    # pointers and integer sizes as the launcher specialises them at the public shapes
    # (multiples of 16), so that loads vectorise as they will on the GPU
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in UNALIGNED and (sig[n] == "i32" or sig[n].startswith("*"))}
    src = ASTSource(jitfn, sig, {(names.index(k),): v for k, v in constexprs.items()}, aligned)
    kernel = triton.compile(src, target=target, options={"num_warps": num_warps, **options})
    print(f"  {jitfn.__name__:28s} {resource_usage(kernel.asm['cubin'])}  {constexprs}")
    if "--mix" in sys.argv or "--loops" in sys.argv:
        code = sass_code(cuobjdump(kernel.asm["cubin"], "-sass"))
        if "--mix" in sys.argv:  # the whole kernel's, loops or not (an epilogue's cost shows here)
            print(f"      kernel: {instruction_mix([i for _, i in code])}")
        if "--loops" in sys.argv:
            for line in loop_summary(code):
                print(f"      {line}")
    if "--conversions" in sys.argv:
        for line in layout_conversions(kernel.asm["ttgir"]):
            print(f"      {line}")
    return kernel


def layout_conversions(ttgir: str) -> list[str]:
    """Each layout conversion in the kernel's Triton GPU IR: the tensor it converts and the
    source lines it comes from (innermost first). A conversion of a 2-D tile goes through
    shared memory with barriers: on a kernel's critical path (after its PDL wait, or in a
    hot loop) it costs what the SASS shows as STS / LDS / BAR."""
    locs = dict(re.findall(r"^#(loc\d*) = loc\((.*)\)$", ttgir, re.M))

    def lines(ref, seen=()):
        text = locs.get(ref, "")
        if ref in seen or not text:
            return []
        found = [f"{Path(f).name}:{n}" for f, n in re.findall(r'"([^"]+\.py)":(\d+)', text)]
        for inner in re.findall(r"#(loc\d*)", text):
            found += lines(inner, seen + (ref,))
        return list(dict.fromkeys(found))

    out = []
    for m in re.finditer(r"ttg\.convert_layout %\S+ : (tensor<[^,>]+)[^\n]*loc\(#(loc\d*)\)", ttgir):
        out.append(f"convert_layout {m.group(1)}> at {', '.join(lines(m.group(2))) or '?'}")
    return out


def cuobjdump(cubin: bytes, option: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), option, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def resource_usage(cubin: bytes) -> str:
    out = cuobjdump(cubin, "--dump-resource-usage")
    found = {k: re.search(rf"\b{k}:(\d+)", out) for k in ("REG", "STACK", "SHARED")}
    return " ".join(f"{k}={m.group(1) if m else '?'}" for k, m in found.items())


LOOP_KINDS = ("MUFU", "FFMA", "FMUL", "FADD", "HMMA", "HGMMA", "LDG", "STG", "LDGSTS", "LDS", "STS", "BAR", "SHFL", "LDL", "STL")


def sass_code(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) for each instruction of a SASS listing."""
    return [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def instruction_mix(body: list[str]) -> str:
    """How many of `body`'s instructions run, those of LOOP_KINDS, and apart those that
    never run (predicated on @!PT: placeholders the assembler leaves)."""
    runs = [re.sub(r"^@!?U?P\w+\s+", "", i) for i in body if not i.startswith("@!PT ")]
    ops = collections.Counter(i.split()[0].split(".")[0] for i in runs)
    kinds = " ".join(f"{k} {ops[k]}" for k in LOOP_KINDS if ops[k])
    never = len(body) - len(runs)
    return f"{len(runs)} instructions; {kinds}" + (f"; never run {never}" if never else "")


def loop_summary(code: list[tuple[int, str]]) -> list[str]:
    """One line a loop (a backward branch) of sass_code's listing: its instruction_mix."""
    lines = []
    for addr, ins in code:
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if branch and int(branch.group(1), 16) < addr:
            start = int(branch.group(1), 16)
            lines.append(f"loop {start:#x}-{addr:#x}: " + instruction_mix([i for a, i in code if start <= a <= addr]))
    return lines


def ptrs(*names, **others):
    """float32 pointers for `names`, plus the other arguments' types."""
    return {**{n: "*fp32" for n in names}, **others}


def main() -> None:
    res = []
    # the one-row step (decode_step.py); FP8 weights (*fp8e4nv) with a float32 scale a row,
    # their embedding bfloat16 (dtypes.embedding_dtype)
    for wdt in ("*bf16", "*fp16", "*fp32", "*fp8e4nv"):
        f32, fp8 = wdt == "*fp32", wdt == "*fp8e4nv"
        edt = "*bf16" if fp8 else wdt
        narrow = one_row_blocks(768, 1536, 50280, torch.float32 if f32 else torch.bfloat16)  # 130m's
        wide = one_row_blocks(2560, 5120, 50280, torch.float32 if f32 else torch.bfloat16)  # 2.8b's
        t = ptrs("h_ptr", "nw_ptr", "b_ptr", "out_ptr", "cs_ptr", "cw_ptr", "cb_ptr", "xc_ptr", "ws_ptr", "wxs_ptr",
                 w_ptr=wdt, wx_ptr=wdt, dh_ptr="*i64", dbc_ptr="*i64", best_ptr="*i64", eps="fp32")
        for conv, mma in ((True, False), (False, False)) + (((True, True),) if not f32 else ()):
            # in_proj with the conv step and x_proj (16-bit and FP8: its products on the tensor cores too);
            # lm_head (a tied one bf16) with the argmax
            compile_kernel(ds._rmsnorm_linear_kernel, {**t, "w_ptr": wdt if conv else edt}, dict(
                W_SCALED=fp8 and conv, WX_SCALED=fp8, HAS_BIAS=True, CONV=conv, ARGMAX=not conv, K=4, KP=4, HAS_CB=True, BN=16,
                BK=512 if not mma else 256, BJ=128, STAGES=narrow.in_proj[3], SUM_LAST=not f32 and not mma,
                UNROLL=narrow.in_proj_unroll if conv and not f32 and not mma else 1, PDL=True, MMA=mma, TWO=False))
        # two matrices over one row in one launch (Falcon-H1's in_proj and q/k/v)
        compile_kernel(ds._rmsnorm_linear_kernel, {**t, "w_ptr": wdt, "w2_ptr": wdt, "ws2_ptr": "*fp32",
                                                   "b2_ptr": "*fp32", "out2_ptr": "*fp32"}, dict(
            W_SCALED=fp8, WX_SCALED=fp8, HAS_BIAS=True, CONV=False, ARGMAX=False, K=4, KP=4, HAS_CB=True, BN=16,
            BK=wide.in_proj[1], BJ=128, STAGES=1, SUM_LAST=not f32, UNROLL=wide.in_proj_unroll if not f32 else 1,
            PDL=True, MMA=False, TWO=True))
        if f32:  # a mixture of experts' router (float32 weights) at Nemotron 3 Nano's width: one tile a row
            BN, BK, warps, stages = one_row_blocks(2688, 4096, 131072, torch.bfloat16, "mamba2").router
            compile_kernel(ds._rmsnorm_linear_kernel, t, dict(
                W_SCALED=False, WX_SCALED=False, HAS_BIAS=False, CONV=False, ARGMAX=False, K=4, KP=4, HAS_CB=False,
                BN=BN, BK=BK, BJ=128, STAGES=stages, SUM_LAST=False, UNROLL=1, PDL=True, MMA=False, TWO=False),
                num_warps=warps)
        t = ptrs("xz_ptr", "cs_ptr", "cw_ptr", "cb_ptr", "xc_ptr", "wxs_ptr", wx_ptr=wdt, dbc_ptr="*i64")
        BN = wide.conv_block
        compile_kernel(ds._conv_x_proj_kernel, t, dict(K=4, KP=4, HAS_CB=True, BN=BN, BJ=256, WX_SCALED=fp8, PDL=True),
                       num_warps=max(4, BN // 16))
        t = ptrs("xc_ptr", "xz_ptr", "ss_ptr", "dtb_ptr", "A_ptr", "D_ptr", "y_ptr", "h_ptr", "dts_ptr", dtw_ptr=wdt,
                 dbc_ptr="*i64", dh_ptr="*i64", eps="fp32")
        BE, warps = wide.ssm_block
        for norm in (False, True):  # plain Mamba, Falcon-Mamba
            compile_kernel(ds._ssm_step_kernel, t, dict(N=16, NP=16, BJ=256, BR=256, BE=BE, BD=4, DBC_NORM=norm,
                                                        DT_SCALED=fp8, PDL=True), num_warps=warps)
        t = {"best_ptr": "*i64", "tok_ptr": "*i64", "hist_ptr": "*i64", "step_ptr": "*i64", "seen_ptr": "*i1"}
        compile_kernel(ds._take_argmax_kernel, t, dict(BR=8, PDL=True))
        t = ptrs("y_ptr", "b_ptr", "ws_ptr", "h_ptr", w_ptr=wdt, dh_ptr="*i64", dbc_ptr="*i64", dhp_ptr="*i64")
        for mma in (False, True) if not f32 else (False,):  # (16-bit and FP8: its products on the tensor cores too)
            compile_kernel(ds._out_proj_residual_kernel, t, dict(W_SCALED=fp8, HAS_BIAS=True, BN=64 if mma else 32, BK=256,
                                                                 BJ=128, PDL=True, MMA=mma, ACT="none", GATED=False, BD=0))
        # a hybrid's o_proj (a fold) and MLP down products (decode_step_hybrid.py)
        for act, gated in (("none", False), ("silu", True), ("relu2", False)):
            compile_kernel(ds._out_proj_residual_kernel, t, dict(W_SCALED=fp8, HAS_BIAS=False, BN=32, BK=256, BJ=0,
                                                                 PDL=True, MMA=False, ACT=act, GATED=gated, BD=8))
        t = {"tok_ptr": "*i64", "emb_ptr": edt, "h_ptr": "*fp32", "dh_ptr": "*i64", "dh2_ptr": "*i64", "mult": "fp32"}
        compile_kernel(ds._embed_kernel, t, dict(BN=32, PDL=True))
        # the deterministic step's products (products.py), in the tiles of 1 and of 128 rows
        for M in (2, 256):
            t = gm._tiles(M, 5120, 2560, 1, f32, sms=132)
            compile_kernel(gm._gemm_kernel, ptrs("out_ptr", "s_ptr", a_ptr=edt, w_ptr=wdt), dict(
                F32=f32, SCALED=fp8, BM=t.BM, BN=t.BN, BK=t.BK, STAGES=t.stages, PDL=True), num_warps=t.warps)
        res.append(f"decode {wdt}: ok")
    for wdt in ("*bf16", "*fp32"):  # the cuBLAS-product step's element-wise kernels
        compile_kernel(rn._residual_rmsnorm_kernel, ptrs("h_ptr", "o_ptr", "b_ptr", "nw_ptr", "h_out_ptr", u_ptr=wdt, eps="fp32"), dict(ADD=True, HAS_BIAS=True, O_PARTS=1, U_HALVES=wdt != "*fp32", BD=4096, PDL=True), num_warps=8)
        BE, warps = PRODUCTS_BLOCKS.conv_step
        compile_kernel(dg._conv_step_kernel, ptrs("xz_ptr", "cs_ptr", "cw_ptr", "cb_ptr", "xc_ptr", xc16_ptr=wdt), dict(K=4, KP=4, HAS_CB=True, XZ_PARTS=2, SPLIT=wdt != "*fp32", BE=BE, PDL=True), num_warps=warps)
        for norm in (False, True):
            compile_kernel(dg._dbc_kernel, ptrs("raw_ptr", "dbc_ptr", dtr_ptr=wdt, eps="fp32"),
                           dict(RAW_PARTS=2, SPLIT=wdt != "*fp32", BJ=256, DBC_NORM=norm, PDL=True), num_warps=1)
        t = ptrs("dt_ptr", "dbc_ptr", "xc_ptr", "xz_ptr", "ss_ptr", "dtb_ptr", "A_ptr", "D_ptr", y_ptr=wdt)
        BE, warps = PRODUCTS_BLOCKS.ssm_update
        compile_kernel(dg._ssm_update_kernel, t, dict(N=16, NP=16, DT_PARTS=2, XZ_PARTS=2, Y_HALVES=False, BE=BE, PDL=True), num_warps=warps)
    res.append("decode (cuBLAS products): ok")
    # a bf16 model's prefill: in_proj writes x and z in bf16 (model.in_proj_dtype), the conv
    # writes its output and the scans y in bf16
    # (with RESETS, the Backbone's episodes: the conv's segment starts, the scans' flags)
    t = ptrs("w_ptr", "b_ptr", "st_ptr", x_ptr="*bf16", y_ptr="*bf16", start_ptr="*i32", first_ptr="*i32")
    for resets in (False, True):
        compile_kernel(cc._causal_conv1d_kernel, t, dict(K=4, KP=4, HAS_BIAS=True, BE=CONV_TILES.be, BT=CONV_TILES.bt,
                                                         STAGES=CONV_TILES.stages, UNROLL=CONV_TILES.unroll, RESETS=resets,
                                                         HAS_START=True),
                       num_warps=CONV_TILES.warps)
    t = ptrs("dt_ptr", "B_ptr", "C_ptr", "A_ptr", "D_ptr", "st_ptr", x_ptr="*bf16", z_ptr="*bf16", y_ptr="*bf16", start_ptr="*i32",
             resets_ptr="*u8")
    for resets in (False, True):
        compile_kernel(ss._selective_scan_kernel, t, dict(N=16, NP=16, BE=8, BT=32, RESETS=resets, RAW_DT=False, SAVE=False))
    for B, T in ((1, 8192), (8, 2048), (1, 2048)):  # chunked_launch's three kinds of launch
        run = ss.chunked_launch(B, 5120, T, SCAN_TILES)
        # (one channel a thread reads x and z as pairs of channels: see ss._channels_at)
        xz = dict(x_ptr="*bf16", z_ptr="*bf16") if run.CPL > 1 else dict(x_ptr="*i32", z_ptr="*i32")
        half = None if run.CPL > 1 else triton.language.bfloat16
        t1 = ptrs("dt_ptr", "B_ptr", "A2t_ptr", "sum_ptr", "dts_ptr", "dtb_ptr", x_ptr=xz["x_ptr"], start_ptr="*i32",
                  resets_ptr="*u8")
        t2 = ptrs("dt_ptr", "B_ptr", "C_ptr", "A2t_ptr", "D_ptr", "st_ptr", "sum_ptr", "init_ptr", "dtb_ptr", **xz, y_ptr="*bf16",
                  start_ptr="*i32", resets_ptr="*u8")
        walk = dict(N=16, NP=16, BE=run.BE, CPL=run.CPL, EVEN=True, STAGES=run.stages, UNROLL=run.unroll, X16=half, RAW_DT=False,
                    RESETS=False)
        for resets in (False, True):
            compile_kernel(ss._scan_summary_kernel, t1, {**walk, "RESETS": resets}, num_warps=run.warps)
            compile_kernel(ss._scan_chunks_kernel, t2, {**walk, "Z16": half, "RESETS": resets}, num_warps=run.warps)
        # a bf16 state (load(state_dtype="bfloat16")): the last chunk stores it rounded once
        compile_kernel(ss._scan_chunks_kernel, {**t2, "st_ptr": "*bf16"}, {**walk, "Z16": half}, num_warps=run.warps)
        if run.L >= T:  # one chunk: the walk takes each step's softplus too (ss.step_and_scan)
            compile_kernel(ss._scan_chunks_kernel, t2, {**walk, "Z16": half, "RAW_DT": True}, num_warps=run.warps)
    t = ptrs("st_ptr", "init_ptr", "sum_ptr", "dts_ptr", "A2t_ptr", start_ptr="*i32")
    for resets in (False, True):
        compile_kernel(ss._scan_prefix_kernel, t, dict(N=16, NP=16, BE=SCAN_TILES.prefix_be, STAGES=SCAN_TILES.stages,
                                                       RESETS=resets), num_warps=SCAN_TILES.prefix_warps)
    for wdt in ("*bf16", "*fp16", "*fp32"):
        compile_kernel(st._step_size_kernel, ptrs("r_ptr", "b_ptr", "out_ptr", w_ptr=wdt), dict(
            IEEE=wdt == "*fp32", BM=STEP_SIZE_TILES.bm, BN=STEP_SIZE_TILES.bn, BK=STEP_SIZE_TILES.bk), num_warps=STEP_SIZE_TILES.warps)
    for xdt in ("*bf16", "*fp32"):  # FP8 prefill: a token's activations quantized for cuBLASLt (fp8_gemm.py)
        compile_kernel(f8._quantize_rows_kernel, {"x_ptr": xdt, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, dict(BK=1024))
    # a mixture of experts' grouped products (moe.py), bf16 and FP8 experts (bf16 operands):
    # gate and up with the gated SiLU, up with the squared ReLU, then down with the router's weights
    # (at both of the plan's tile sets: a decode step's few tokens, a prefill chunk's many)
    for wdt, mt in itertools.product(("*bf16", "*fp8e4nv"), (MOE_TILES.few, MOE_TILES.many)):
        t = ptrs("s_ptr", "rw_ptr", x_ptr="*bf16", w_ptr=wdt, ids_ptr="*i64", bexp_ptr="*i64", nblocks_ptr="*i64")
        tiles = dict(F32=False, SCALED=wdt == "*fp8e4nv", BM=mt.bm, BN=mt.bn, BK=mt.bk, STAGES=mt.stages)
        for act, gated in (("silu", True), ("relu2", False)):
            compile_kernel(mo._moe_gemm_kernel, {**t, "out_ptr": "*bf16"},
                           dict(ACT=act, GATED=gated, MUL_WEIGHT=False, **tiles), num_warps=mt.warps)
        compile_kernel(mo._moe_gemm_kernel, {**t, "out_ptr": "*fp32"},
                       dict(ROW_DIV=1, ACT="none", GATED=False, MUL_WEIGHT=True, **tiles), num_warps=mt.warps)
    # the one-row step's experts (decode_step_hybrid.py): bf16 on the CUDA cores or the tensor
    # cores, FP8 on the tensor cores
    for wdt, mma in (("*bf16", False), ("*bf16", True), ("*fp8e4nv", True)):
        scaled = wdt == "*fp8e4nv"
        t = ptrs("h_ptr", "nw_ptr", "ws_ptr", "sws_ptr", "a_ptr", dh_ptr="*i64", ex_ptr="*i64", w_ptr=wdt, sw_ptr=wdt,
                 eps="fp32")
        compile_kernel(hy._moe_in_kernel, t, dict(K=6, ACT="silu", GATED=True, W_SCALED=scaled, BN=16, BK=512, MMA=mma,
                                                  PDL=True))
        t = ptrs("a_ptr", "rw_ptr", "ws_ptr", "sws_ptr", "h_ptr", ex_ptr="*i64", w_ptr=wdt, sw_ptr=wdt, dh_ptr="*i64",
                 dhp_ptr="*i64")
        compile_kernel(hy._moe_out_kernel, t, dict(K=6, SPLITS=1, W_SCALED=scaled, BN=16 if mma else 8, BK=512, BD=2,
                                                   MMA=mma, PDL=True))
    # the grouping in one program and in chunks (64 experts, Granite-4.0-H-Tiny's) and the picks' sum
    align = ptrs(experts_ptr="*i64", ids_ptr="*i64", bexp_ptr="*i64", nblocks_ptr="*i64", counts_ptr="*i32")
    compile_kernel(mo._align_kernel, align, dict(BM=MOE_TILES.few.bm, BE=128, BC=32))
    compile_kernel(mo._align_count_kernel, align, dict(E=64, BE=128, CHUNK=MOE_TILES.many.align_chunk, BC=32))
    compile_kernel(mo._align_place_kernel, align, dict(BM=MOE_TILES.many.bm, BE=128, CHUNK=MOE_TILES.many.align_chunk, BC=32))
    compile_kernel(mo._sum_picks_kernel, ptrs("y_ptr", "add_ptr", "out_ptr"), dict(K=6, BD=1024, HAS_ADD=True))
    # the routers: Granite-4.0-H-Tiny's softmax of the top 6 of 64, Nemotron 3 Nano's sigmoid
    # with its correction bias, 6 of 128
    for router, E in (("softmax", 64), ("sigmoid", 128), ("softmax_all", 16)):
        compile_kernel(mo._route_kernel, ptrs("logits_ptr", "bias_ptr", "weights_ptr", experts_ptr="*i64", scaling="fp32"),
                       dict(K=6 if E > 16 else 2, KP=8 if E > 16 else 2, BE=E, ROUTER=router,
                            HAS_BIAS=router == "sigmoid", NORM=True), num_warps=1)
    res.append("prefill conv + step sizes + scan + FP8 quantize + MoE: ok")
    # training (fastmamba.Backbone under autograd, float32): the forward scan saving its
    # chunks' states, the scan's and the conv's backward
    t = ptrs("x_ptr", "dt_ptr", "B_ptr", "C_ptr", "z_ptr", "A_ptr", "D_ptr", "st_ptr", "y_ptr", "dtb_ptr", "saved_ptr",
             start_ptr="*i32", resets_ptr="*u8")
    train = TRAIN_SCAN_TILES
    compile_kernel(ss._selective_scan_kernel, t, dict(N=16, NP=16, BE=train.be, BT=train.bt, RESETS=True, RAW_DT=True,
                                                      SAVE=True), num_warps=train.warps)
    t = ptrs("x_ptr", "dt_ptr", "z_ptr", "dy_ptr", "B_ptr", "C_ptr", "dtb_ptr", "A_ptr", "D_ptr", "saved_ptr", "dfinal_ptr",
             "dx_ptr", "ddt_ptr", "dz_ptr", "dB_ptr", "dC_ptr", "dA_ptr", "dD_ptr", "dinit_ptr", resets_ptr="*u8")
    # (PARTIALS: the deterministic mode's per-program sums in place of the atomics)
    for partials in (False, True):
        compile_kernel(sg._scan_backward_kernel, t, dict(N=16, NP=16, BE=train.be, BT=train.bt, RESETS=True,
                                                         PARTIALS=partials), num_warps=train.warps)
    t = ptrs("x_ptr", "st_ptr", "w_ptr", "b_ptr", "dy_ptr", "dpre_ptr", "dw_ptr", "db_ptr", "dx_ptr", first_ptr="*i32")
    tiles = dict(BE=CONV_GRAD_TILES.be, BT=CONV_GRAD_TILES.bt)
    for partials in (False, True):
        compile_kernel(cg._conv_grad_pre_kernel, t, dict(K=4, HAS_BIAS=True, RESETS=True, PARTIALS=partials, **tiles),
                       num_warps=CONV_GRAD_TILES.warps)
    compile_kernel(cg._conv_grad_input_kernel, t, dict(K=4, RESETS=True, **tiles), num_warps=CONV_GRAD_TILES.warps)
    res.append("training scan + conv (atomics, and the deterministic partial sums): ok")
    # Mamba-2 at mamba2-2.7b's shapes: the decode step's scan, the gated norm
    t = ptrs("x_ptr", "B_ptr", "C_ptr", "dt_ptr", "dtb_ptr", "A_ptr", "D_ptr", "st_ptr", "y_ptr", dt_min="fp32", dt_max="fp32")
    for state in ("*fp32", "*bf16"):
        compile_kernel(sd._ssd_step_kernel, {**t, "st_ptr": state}, dict(H=80, P=64, N=128, BP=SSD_TILES.step_bp, NP=128),
                       num_warps=SSD_TILES.step_warps)
    compile_kernel(gn._gated_rmsnorm_kernel, ptrs("y_ptr", "z_ptr", "w_ptr", out_ptr="*bf16", eps="fp32"),
                   dict(GS=5120, BG=8192, NORM_BEFORE_GATE=False), num_warps=16)
    # the chunked SSD, bf16 operands (the conv's output) and float32 (three TF32 passes), with
    # and without resets
    for xdt, resets in itertools.product(("*bf16", "*fp32"), (False, True)):
        dims = dict(H=80, P=64, N=128, Q=SSD_TILES.chunk, NP=128, F32=xdt == "*fp32", RESETS=resets)
        t = ptrs("dt_ptr", "cum_ptr", "st_ptr", "D_ptr", "y_ptr", "cb_ptr", x_ptr=xdt, B_ptr=xdt, C_ptr=xdt,
                 starts_ptr=xdt, first_ptr="*i32")
        compile_kernel(sd._ssd_chunk_state_kernel, t, dict(BS=SSD_TILES.bs, BP=SSD_TILES.state_bp, **dims))
        for cb_once in (False, True):
            compile_kernel(sd._ssd_chunk_scan_kernel, t, dict(BT=SSD_TILES.bt, BS=SSD_TILES.bs, BP=64, CB_ONCE=cb_once, G=1,
                                                              **dims), num_warps=SSD_TILES.scan_warps)
        if not resets:
            compile_kernel(sd._ssd_chunk_cb_kernel, t, dict(G=1, N=128, Q=SSD_TILES.chunk, BT=SSD_TILES.bt, BS=SSD_TILES.bs,
                                                            NP=128, F32=dims["F32"]))
    for resets, starts in ((False, "*bf16"), (True, "*bf16"), (False, "*fp32")):
        compile_kernel(sd._ssd_state_passing_kernel, ptrs("st_ptr", "layer_ptr", "cum_ptr", starts_ptr=starts,
                                                          first_ptr="*i32"),
                       dict(H=80, PN=64 * 128, Q=SSD_TILES.chunk, BL=SSD_TILES.pass_bl, CB=SSD_TILES.pass_cb, RESETS=resets),
                       num_warps=SSD_TILES.pass_warps)
    for start in (False, True):  # the step sizes and their running sums, from in_proj's float32 output
        compile_kernel(sd._ssd_step_sizes_kernel, ptrs("dt_ptr", "dtb_ptr", "A_ptr", "out_ptr", "cum_ptr",
                                                       start_ptr="*i32", dt_min="fp32", dt_max="fp32"),
                       dict(H=80, Q=SSD_TILES.chunk, BH=SSD_TILES.sizes_bh, START=start))
    # Mamba-2's one-row step (decode_step_mamba2.py) at 2.7b's and Codestral's shapes, bf16 or
    # FP8 out_proj
    for (E, G, H, d), wdt in itertools.product(((5120, 1, 80, 2560), (8192, 8, 128, 4096)), ("*bf16", "*fp8e4nv")):
        wide2 = one_row_blocks(d, E, 50280, torch.bfloat16, "mamba2")
        t = ptrs("zx_ptr", "cw_ptr", "cb_ptr", "dtb_ptr", "A_ptr", "D_ptr", "v_ptr", "part_ptr", "h_ptr",
                 cs_ptr="*bf16", ss_ptr="*fp32", dh_ptr="*i64", dt_min="fp32", dt_max="fp32")
        compile_kernel(s2._ssd_conv_step_kernel, t, dict(E=E, G=G, N=128, H=H, P=64, K=4, KP=4, HAS_CB=True,
                                                         BP=wide2.ssd_block, NP=128, BD=8, NORM_BEFORE_GATE=False, PDL=True))
        parts = H * 64 // wide2.ssd_block
        t = ptrs("v_ptr", "zx_ptr", "part_ptr", "gw_ptr", "b_ptr", "ws_ptr", w_ptr=wdt, dh_ptr="*i64", cs_ptr="*bf16",
                 eps="fp32")
        # (its products on the tensor cores too; without the norm: Falcon-H1's option)
        for mma, norm in ((False, True), (True, True), (False, False)):
            compile_kernel(s2._gated_out_proj_kernel, t, dict(E=E, G=G, N=128, H=H, K=4, KP=4, PARTS=parts,
                                                              PPG=parts // G, GP=triton.next_power_of_2(G),
                                                              PPGP=triton.next_power_of_2(parts // G), HAS_BIAS=False,
                                                              NORM=norm, NORM_BEFORE_GATE=False, BN=64, BK=128, BC=4,
                                                              TILE_IN_GROUP=True, W_SCALED=wdt == "*fp8e4nv", PDL=True,
                                                              MMA=mma))
    res.append("mamba2 step + gated norm + chunked scan + one-row step: ok")
    t = ptrs("logits_ptr", "pen_ptr", "temp_ptr", "s_ptr", "smax_ptr", "bias_ptr", "presence_ptr", "frequency_ptr",
             seen_ptr="*i1", best_ptr="*i64", count_ptr="*i32", mask_ptr="*i32")
    BV, NB, CAP = SAMPLER_TILES.bv, SAMPLER_TILES.nb, SAMPLER_TILES.cap
    # (as _sample launches it: with penalties, no fused multiply-adds; masked: with a bitmask)
    for penalties, masked in itertools.product((False, True), (False, True)):
        compile_kernel(sp._scale_kernel, t, dict(PENALTIES=penalties, MASKED=masked, BV=BV), enable_fp_fusion=not penalties)
    for ldt in ("*fp32", "*bf16"):  # the argmax of a greedy batch with a guided row, of float32 or 16-bit logits
        compile_kernel(sp._greedy_kernel, {"logits_ptr": ldt, "mask_ptr": "*i32", "best_ptr": "*i64"},
                       dict(MASKED=True, BV=BV))
    rows = ptrs("s_ptr", "smax_ptr", "temp_ptr", "topp_ptr", "minp_ptr", topk_ptr="*i64", st_ptr="*i64", T_ptr="*i64", cnt_ptr="*i64",
                mass_ptr="*i64", nmin_ptr="*i64", zq_ptr="*i64", lim_ptr="*fp64", ctr_ptr="*i64", scratch_ptr="*i64", kstar_ptr="*i64")
    for stage in (0, 1):
        for first in (True, False):
            compile_kernel(sp._count_kernel, rows, dict(FIRST=first, STAGE=stage, NB=NB, BV=BV))
            compile_kernel(sp._narrow_kernel, rows, dict(FIRST=first, STAGE=stage, NB=NB, CAP=CAP), num_warps=1)
        compile_kernel(sp._resolve_kernel, rows, dict(STAGE=stage, NB=NB, CAP=CAP, BV=BV), num_warps=8)
    compile_kernel(sp._gather_kernel, rows, dict(CAP=CAP, BV=BV))
    t = ptrs("s_ptr", seed_ptr="*i64", step_ptr="*i64", kstar_ptr="*i64", best_ptr="*i64")
    for filtered in (False, True):
        compile_kernel(sp._pick_kernel, t, dict(FILTERED=filtered, BV=BV))
    t = {"best_ptr": "*i64", "temp_ptr": "*fp32", "tok_ptr": "*i64", "step_ptr": "*i64", "seen_ptr": "*i1",
         "count_ptr": "*i32"}
    for penalties in (False, True):
        compile_kernel(sp._finish_kernel, t, dict(PENALTIES=penalties, BR=64))
    res.append("sampler: ok")
    # a hybrid's decode attention (paged_attention.py) at Nemotron-H-8B's heads (32 query, 8
    # key-value, 128 wide), bf16 keys and values: the rotation (half the dims, as Bamba's, and
    # none) and store, the splits, their sum; the decode conv without a start tensor
    H, KVH, hd = 32, 8, 128
    for rot in (64, 0):
        compile_kernel(pa._rope_store_kernel, ptrs("qkv_ptr", "q_ptr", k_ptr="*bf16", v_ptr="*bf16",
                                                   table_ptr="*i64", len_ptr="*i64", rows_ptr="*i64",
                                                   log2_theta="fp32"),
                       dict(H=H, KVH=KVH, HD=hd, HP=hd, BS=16, ROT=rot), num_warps=1)
    for heads, kv_heads in ((H, KVH), (12, 2)):  # (and Falcon-H1-7B's 12 over 2: 64 splits to add up)
        splits, rep = PAGED_TILES.programs // kv_heads, heads // kv_heads
        compile_kernel(pa._paged_decode_kernel, ptrs("q_ptr", "m_ptr", "l_ptr", "acc_ptr", k_ptr="*bf16",
                                                     v_ptr="*bf16", table_ptr="*i64", len_ptr="*i64",
                                                     rows_ptr="*i64", scale="fp32"),
                       dict(KVH=kv_heads, REP=rep, RP=triton.next_power_of_2(rep), QP=16, HD=hd, HP=hd, BS=16,
                            BN=PAGED_TILES.tokens, SPLITS=splits, F32=False), num_warps=PAGED_TILES.warps)
        compile_kernel(pa._paged_combine_kernel, ptrs("m_ptr", "l_ptr", "acc_ptr", "out_ptr", len_ptr="*i64",
                                                      rows_ptr="*i64"),
                       dict(KVH=kv_heads, REP=rep, RP=triton.next_power_of_2(rep), HD=hd, HP=hd,
                            BN=PAGED_TILES.tokens, SPLITS=splits, SP=triton.next_power_of_2(splits)), num_warps=4)
    t = ptrs("w_ptr", "b_ptr", "st_ptr", x_ptr="*fp32", y_ptr="*bf16", start_ptr="*bf16", first_ptr="*bf16")
    compile_kernel(cc._causal_conv1d_kernel, t, dict(K=4, KP=4, HAS_BIAS=True, BE=CONV_TILES.be, BT=CONV_TILES.bt,
                                                     STAGES=CONV_TILES.stages, UNROLL=CONV_TILES.unroll, RESETS=False,
                                                     HAS_START=False), num_warps=CONV_TILES.warps)
    res.append("hybrid decode attention + conv: ok")
    # the Backbone's lockstep step (128 x 3, input 64) in the plan's two shapes: a row a group
    # (multiply-and-sum, bf16 weights) and 16 (the tensor cores, float32 weights' tf32x3), a bf16 state
    for wdt, r in (("*bf16", LOCKSTEP_SHAPES[0]), ("*fp32", LOCKSTEP_SHAPES[1])):
        t = ptrs("x_ptr", "y_ptr", "ipb_ptr", "normf_ptr", "hs_ptr", "share_ptr", conv_ptr="*bf16", ssm_ptr="*bf16",
                 table_ptr="*i64", ipw_ptr=wdt, count_ptr="*i64", eps="fp32")
        compile_kernel(ls._lockstep_step_kernel, t, dict(
            I=64, IP=64, D=128, DP=128, E=256, N=16, NP=16, K=4, R=8, RP=16, RB=r.rows, P=256 // r.channels, BD=32,
            WTYPE=triton.language.bfloat16 if wdt == "*bf16" else triton.language.float32,
            INPUT_PROJ=True, PROJ_BIAS=True, CONV_BIAS=True), num_warps=r.warps)
    res.append("backbone lockstep step: ok")
    print("\n".join(res))


if __name__ == "__main__":
    main()

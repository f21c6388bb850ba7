"""Mamba-2 on the GPU engine beside mamba_ssm's own Mamba2, same run, random weights, bf16:
the decode step in CUDA graphs (greedy: the argmax inside both graphs) at batch 1 and 128,
prefill of 1 x 8192 and 8 x 2048 (last position's logits), and the scan alone (ours against
mamba_ssm's Triton `mamba_chunk_scan_combined`).

mamba_ssm runs from its Python source (its Triton kernels; no compiled extension, no
causal_conv1d: its conv steps take its PyTorch fallback). Put the source where Python finds
it (PYTHONPATH), e.g. the `mamba_ssm` folder of github.com/state-spaces/mamba.

    PYTHONPATH=.peer python -m benchmarks.mamba2 --models mamba2-130m,mamba2-2.7b,codestral-7b --json m2.json
    PYTHONPATH=.peer python -m benchmarks.mamba2 --scan-kernels  # where the scan's time goes, both sides
    PYTHONPATH=.peer python -m benchmarks.mamba2 --prefill  # prefill and the scan alone, both sides
    python -m benchmarks.mamba2 --in-proj-tiles  # the one-row step's in_proj tiles, ours alone

Our decode under each Mamba-2 plan (the one-row step, the layer over the GPU ops with cuBLAS
or Triton products): `python -m benchmarks.decode_routing --models mamba2-130m,mamba2-2.7b`.
"""

import argparse
import itertools
import json
from pathlib import Path

import torch

from fastmamba.bench import (
    SHAPES,
    copy_bandwidth,
    floor_ms,
    gpu_ms,
    random_model,
    time_graph_steps,
)
from fastmamba.engine.cuda_graphs import capture_graph


def peer_model(c, dtype):
    """mamba_ssm's MambaLMHeadModel of this config (random init), or the import error."""
    try:
        from mamba_ssm.models.config_mamba import MambaConfig as PeerConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    except Exception as err:  # (no mamba_ssm source on the path, or a missing need of it)
        return f"{type(err).__name__}: {err}"
    ssm = dict(layer="Mamba2", d_state=c.d_state, d_conv=c.d_conv, expand=c.d_inner // c.d_model, headdim=c.head_dim,
               ngroups=c.n_groups, chunk_size=c.chunk_size, use_mem_eff_path=False)
    cfg = PeerConfig(d_model=c.d_model, d_intermediate=0, n_layer=c.n_layer, vocab_size=c.vocab_size, ssm_cfg=ssm,
                     rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
                     tie_embeddings=c.tie_embeddings)
    torch.manual_seed(0)
    return MambaLMHeadModel(cfg, device="cuda", dtype=dtype).eval()


def peer_decode_ms(model, batch: int) -> float:
    """ms a step of mamba_ssm's decode (its step path, as its CUDA-graph generation runs
    it), argmax included, replayed from one CUDA graph."""
    from mamba_ssm.utils.generation import InferenceParams

    params = InferenceParams(max_seqlen=128, max_batch_size=batch)
    params.key_value_memory_dict = model.allocate_inference_cache(batch, 128, dtype=torch.bfloat16)
    params.seqlen_offset = 1  # past the prompt: every layer takes its one-token step
    ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")

    def body():
        ids.copy_(model(ids, inference_params=params, num_last_tokens=1).logits[:, -1].argmax(-1, keepdim=True))

    with torch.inference_mode():
        graph, _ = capture_graph(body)
        for _ in range(5):
            graph.replay()
        return sorted(gpu_ms(graph.replay, 20, 5))[2]


def ms_of(fn) -> float:
    with torch.inference_mode():
        fn()
        return sorted(gpu_ms(fn, 3, 3))[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mamba2-130m,mamba2-2.7b,codestral-7b")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--scan-kernels", action="store_true",
                    help="only the scan alone at 1 x 8192, with each side's kernels' GPU time (torch.profiler)")
    ap.add_argument("--prefill", action="store_true", help="prefill and the scan alone only, both sides (no decode)")
    ap.add_argument("--in-proj-tiles", action="store_true",
                    help="only our batch-1 one-row step with in_proj's rows and K tile a program varied")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy rate {bw / 1e12:.2f} TB/s")
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for size in args.models.split(",") if args.scan_kernels else ():
        scan_rows(size, SHAPES[size], emit, kernels=True)
    for size in args.models.split(",") if args.in_proj_tiles else ():
        in_proj_rows(size, emit)
    for size in args.models.split(",") if not (args.scan_kernels or args.in_proj_tiles) else ():
        dtype = torch.bfloat16
        c = SHAPES[size]
        for state_dtype in (torch.float32,) if args.prefill else (torch.float32, torch.bfloat16):
            ours = random_model(size, dtype, state_dtype=state_dtype)
            for batch in (int(b) for b in args.batches.split(",") if not args.prefill):
                ms = time_graph_steps(ours, batch)
                floor = floor_ms(ours, batch, bw)
                emit(model=size, engine="fastmamba", state=str(state_dtype)[6:], batch=batch, decode_ms=round(ms, 3),
                     floor_ms=round(floor, 3), of_floor=round(floor / ms, 3))
            if state_dtype == torch.float32:
                for B, T in ((1, 8192), (8, 2048)):
                    ids = torch.randint(0, c.vocab_size, (B, T), device="cuda")
                    ms = ms_of(lambda: ours.prefill(ids, ours.new_state(B), last_only=True))
                    emit(model=size, engine="fastmamba", prefill=f"{B}x{T}", ms=round(ms, 2))
            ours = None
            torch.cuda.empty_cache()
        peer = peer_model(c, dtype)
        if isinstance(peer, str):
            emit(model=size, engine="mamba_ssm", error=peer)
            continue
        for batch in (int(b) for b in args.batches.split(",") if not args.prefill):
            emit(model=size, engine="mamba_ssm", state="bfloat16", batch=batch, decode_ms=round(peer_decode_ms(peer, batch), 3))
        for B, T in ((1, 8192), (8, 2048)):
            ids = torch.randint(0, c.vocab_size, (B, T), device="cuda")
            emit(model=size, engine="mamba_ssm", prefill=f"{B}x{T}", ms=round(ms_of(lambda: peer(ids, num_last_tokens=1)), 2))
        scan_rows(size, c, emit)
        peer = None
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=2))


def in_proj_rows(size: str, emit) -> None:
    """ms a graph-replayed batch-1 one-row step with in_proj's (rows, K tile) a program varied
    (decode_plan.one_row_blocks' in_proj; Mamba-2's in_proj has 2E + 2GN + H rows, not
    Mamba-1's 2E, so their program counts fill the GPU's waves differently)."""
    from dataclasses import replace

    from fastmamba.engine.plan import DecodePlan, one_row_blocks

    model = random_model(size, torch.bfloat16)
    c = model.config
    base = one_row_blocks(c.d_model, c.d_inner, c.vocab_size, torch.bfloat16, "mamba2")
    rows = 2 * c.d_inner + 2 * c.n_groups * c.d_state + c.n_heads
    for BN, BK in itertools.product((8, 16, 32), (256, 512) if c.d_model > 1024 else (base.in_proj[1],)):
        plan = DecodePlan("one-row", blocks=replace(base, in_proj=(BN, BK, *base.in_proj[2:])))
        emit(model=size, batch=1, in_proj_rows=BN, in_proj_k_tile=BK, programs=-(-rows // BN),
             default=(BN, BK) == base.in_proj[:2], ms=round(time_graph_steps(model, 1, plan=plan), 4))
    torch.cuda.empty_cache()


def scan_rows(size: str, c, emit, kernels: bool = False) -> None:
    """The scan alone at 1 x 8192: kernels/ssd.ssd_scan against mamba_chunk_scan_combined
    (kernels: and each one's GPU time by kernel, to see where the scan's time goes)."""
    from benchmarks.tune_ssd_scan import inputs, scan_calls

    B, T, H, P, G, N = 1, 8192, c.n_heads, c.head_dim, c.n_groups, c.d_state
    # (bf16 x, B and C, as a bf16 model's conv gives them, on both sides)
    ours, theirs = scan_calls(inputs(B, T, H, P, G, N), c.chunk_size, c.dt_limit)
    if theirs is None:
        raise SystemExit("mamba_ssm's source is not on the path (PYTHONPATH): see this script's doc")

    emit(model=size, scan=f"{B}x{T} H{H} P{P} G{G} N{N}", fastmamba_ms=round(ms_of(ours), 3),
         mamba_ssm_ms=round(ms_of(theirs), 3))
    if kernels:  # and by kernel, ours with C B^T in each head's program and once a group (SSDTiles.cb_once)
        from dataclasses import replace

        from benchmarks.profile_step import print_kernel_times
        from fastmamba.engine.plan import SSD_TILES

        data = inputs(B, T, H, P, G, N)
        with torch.inference_mode():
            for cb_once in (SSD_TILES.cb_once, not SSD_TILES.cb_once):  # (the plan's time is the row above)
                scan = scan_calls(data, c.chunk_size, c.dt_limit, tiles=replace(SSD_TILES, cb_once=cb_once))[0]
                if cb_once != SSD_TILES.cb_once:
                    emit(model=size, scan=f"{B}x{T}", cb_once=cb_once, fastmamba_ms=round(ms_of(scan), 3))
                print_kernel_times(scan, f"{size} fastmamba scan, cb_once={cb_once}", rows=8)
            print_kernel_times(theirs, f"{size} mamba_ssm scan", rows=8)


if __name__ == "__main__":
    main()

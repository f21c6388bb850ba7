"""Per-kernel GPU time of one decode step (torch.profiler), to see where a step's time goes.
With --backbone DxL: fastmamba.Backbone's step (d_model D, n_layer L, input_dim 64) at each
of --batches, its kernels run eagerly (the same the graph replays), the state's copy time,
and the host's share of a call (the copy in, the replay, the clone out), timed back to back.

    python -m benchmarks.profile_step --model 2.8b --batch 1
    python -m benchmarks.profile_step --model mamba2-2.7b --batch 1 --step one-row
    python -m benchmarks.profile_step --backbone 128x3 --dtype float32 --batches 1,1024,4096
    python -m benchmarks.profile_step --backbone 128x3 --layer mamba2 --dtype float32 --batches 16,256
    python -m benchmarks.profile_step --model granite-4.0-h-tiny --batch 1   # a hybrid (HYBRID_SHAPES):
        # the plan's step after a --context-token prompt, eagerly (the kernels the graph replays),
        # its state in --state-dtype
"""

import argparse

import torch

from fastmamba.bench import HYBRID_SHAPES, host_us, random_model
from fastmamba.core.dtypes import parse_dtype, parse_state_dtype
from fastmamba.core.model import Mamba
from fastmamba.core.state import MambaState
from fastmamba.engine.decode_step import make_decode_step
from fastmamba.engine.plan import DecodePlan


def print_kernel_times(fn, title: str, warm: int = 3, calls: int = 5, rows: int = 14, host: bool = False,
                       width: int = 50) -> None:
    """torch.profiler's table of the GPU kernels of `calls` calls of fn() (after `warm`), by
    their total GPU time; host: the host's operations in it too."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{title}: GPU time of {calls} calls' kernels ({launches / calls:.0f} launches a call)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=width))


def profile_backbone(shape: str, dtype: torch.dtype, batches: list[int], layer: str) -> None:
    from fastmamba import Backbone, BackboneConfig
    from fastmamba.engine.backbone_step import step_kernels

    d_model, n_layer = map(int, shape.split("x"))
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=64, d_model=d_model, n_layer=n_layer, layer=layer), device="cuda", dtype=dtype)
    for batch in batches:
        state = bb.new_state(batch)
        x = torch.randn(batch, bb.config.input_dim, device="cuda")
        # (the kernels the step's graph replays: the plan's for Mamba-1, the module's own step on the GPU ops for Mamba-2)
        step = step_kernels(bb, batch) if layer == "mamba1" else bb._step_eager
        with torch.no_grad():
            print_kernel_times(lambda: step(x, state), f"\n== backbone {shape} {dtype} batch {batch}", calls=10, rows=16)
        nbytes = sum(t.numel() * t.element_size() for t in (state.conv, state.ssm))
        buf = torch.empty(nbytes // 4, device="cuda")
        out = torch.empty_like(buf)
        print(f"state {nbytes / 1e6:.1f} MB: read and written by one copy in {host_us(lambda: out.copy_(buf), 200, warm=20):.1f} us")
        bb.step(x, state)
        g = bb._last_graph
        parts = {
            "public step": lambda: bb.step(x, state),
            "replay alone": g.device_graph.replay,
            "copy in": lambda: g.x.copy_(x),
            "clone out": lambda: g.y.clone(),
            **({"A_log check": g.kernels.sync} if g.kernels is not None else {}),
            "copy + replay + clone": lambda: (g.x.copy_(x), g.device_graph.replay(), g.y.clone()),
        }
        for name, fn in parts.items():
            print(f"  {name}: {host_us(fn, 500 if batch > 256 else 2000, warm=20):.1f} us a call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant step")
    ap.add_argument("--step", choices=("one-row", "products", "layer-ops"),
                    help="this step (decode_plan.DecodePlan's default settings) in place of the plan table's")
    ap.add_argument("--backbone", metavar="DxL", help="a Backbone's step instead of a language model's")
    ap.add_argument("--batches", default="1,1024,4096", help="with --backbone")
    ap.add_argument("--layer", default="mamba1", choices=("mamba1", "mamba2"), help="with --backbone: its layers")
    ap.add_argument("--context", type=int, default=1024, help="a hybrid's prompt tokens a row before the step")
    ap.add_argument("--state-dtype", default="float32", help="a hybrid's state: float32 or bfloat16")
    args = ap.parse_args()
    if args.backbone:
        profile_backbone(args.backbone, parse_dtype(args.dtype), [int(b) for b in args.batches.split(",")], args.layer)
        return
    tokens = torch.zeros(args.batch, dtype=torch.int64, device="cuda")
    if args.model in HYBRID_SHAPES:  # (bf16 weights, its own state and KV cache, the prompt first)
        from benchmarks.hybrid import model_of

        model = model_of(args.model, "cuda")[0]
        model = Mamba(model.config, model.weights, model.ops, state_dtype=parse_state_dtype(args.state_dtype))
        state = model.new_state(args.batch, args.context + 64)
        with torch.no_grad():
            model.prefill(torch.zeros(args.batch, args.context, dtype=torch.int64, device="cuda"), state, last_only=True)
        # as the engine's graphs step it: blocks reserved ahead (the steps' keys and values
        # past them land in the last block), the lengths advanced on the device alone
        for r in range(args.batch):
            state.kv.reserve(r, args.context + 64)
        state = MambaState(state.conv, state.ssm, state.kv, kv_host=False)
    else:
        model = random_model(args.model, parse_dtype(args.dtype))
        state = model.new_state(args.batch)
    plan = DecodePlan(args.step) if args.step else None  # (None: the step the engine would run)
    step = make_decode_step(model, args.batch, args.deterministic, plan)
    print_kernel_times(lambda: step(tokens, state), f"{args.model} {args.dtype} batch {args.batch}", rows=24)


if __name__ == "__main__":
    main()

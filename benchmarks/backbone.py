"""fastmamba.Backbone on the GPU: the step at batch 1-4096 (device tensors and numpy in and
out), the sequence pass forward and forward + backward, beside cuDNN's LSTM and GRU steps
in CUDA graphs and the backbone's eager step. The floor at large batches: the state read
and written once a step, at the copy rate (floor_fraction: the floor over the graph's
replay). With --cpu: the batch-1 step on the CPU. Each step row names the step that ran
(LockstepKernels or KernelStep, engine/backbone_step.py); --steps runs the batches under
each of the plan's choice ("plan"), the decode kernels' step ("kernels") and the lockstep
step wherever it fits ("lockstep").

    python -m benchmarks.backbone --json backbone.json
    python -m benchmarks.backbone --step-only --json step.json   # the steps and the cuDNN cells
    python -m benchmarks.backbone --step-only --steps kernels,lockstep   # the two steps, A/B
    python -m benchmarks.backbone --training --json training.json   # forward + backward only
    python -m benchmarks.backbone --training --autocast --deterministic   # the modes' costs
    python -m benchmarks.backbone --training --layer mamba2   # Mamba-2 layers (heads of 64)
    python -m benchmarks.backbone --step-only --layer mamba2 --deterministic   # its step's products in Triton

--training: forward + backward (the training kernels) and its peak memory beside cuDNN
LSTMs of the issue's sizes, in float32 with PyTorch's defaults (cuDNN may use TF32, cuBLAS
float32 products do not), then again with TF32 products allowed; and the scan's and the
conv's kernels alone, forward + backward, at the first shape. --autocast runs the backbone's
passes under torch.autocast("cuda", bfloat16) (float32 parameters; the LSTM peers too),
--deterministic makes the backbone Backbone(deterministic=True), for the step too (its products
through the batch-invariant Triton GEMM, not cuBLAS): each row says which.
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from fastmamba import Backbone, BackboneConfig
from fastmamba.bench import copy_bandwidth, host_us
from fastmamba.core.layers import state_bytes
from fastmamba.engine import plan

PLANNED = plan.LOCKSTEP_ROUTES
# --steps lockstep: the lockstep step at every batch its grid fits (its shapes' rows, widened)
LOCKSTEP_EVERYWHERE = tuple(replace(r, batches=(1, 8) if r.rows < 16 else (9, 1 << 30)) for r in plan.LOCKSTEP_SHAPES)

SHAPES = {"128x3": dict(input_dim=64, d_model=128, n_layer=3), "512x4": dict(input_dim=64, d_model=512, n_layer=4)}
# --layer mamba2: heads of 64 (BackboneConfig's default), the states of the earlier inline runs
MAMBA2_STATES = {"128x3": 64, "512x4": 128}


def config(name: str, layer: str) -> BackboneConfig:
    """The Backbone of shape `name` with layers of `layer` (mamba1 or mamba2)."""
    if layer == "mamba2":
        return BackboneConfig(**SHAPES[name], layer="mamba2", d_state=MAMBA2_STATES[name])
    return BackboneConfig(**SHAPES[name])


def rnn_step_us(kind: str, batch: int) -> float:
    """µs a step of a cuDNN LSTM or GRU (64 -> 256), replayed from a CUDA graph."""
    from fastmamba.engine.cuda_graphs import capture_graph

    rnn = getattr(torch.nn, kind)(64, 256, device="cuda")
    x = torch.randn(1, batch, 64, device="cuda")
    h = torch.zeros(1, batch, 256, device="cuda")
    state = (h, h.clone()) if kind == "LSTM" else h
    with torch.no_grad():
        graph, _ = capture_graph(lambda: rnn(x, state))
        return host_us(graph.replay, 200)


# (backbone shape, batch x time, the cuDNN LSTM peer: input, hidden, layers)
TRAINING = [("128x3", 16, 1024, (64, 256, 1)), ("512x4", 64, 256, (64, 512, 4)), ("512x4", 64, 256, (64, 512, 1))]


def timed_peak(fn, reps: int):
    """(ms a call, peak memory in MB above what was allocated before) of fn."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return host_us(fn, reps) / 1e3, peak


def training_rows(emit, autocast: bool = False, deterministic: bool = False, layer: str = "mamba1") -> None:
    from contextlib import nullcontext

    from fastmamba.kernels.conv_grad import causal_conv1d_train

    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else nullcontext

    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for name, B, T, (inp, hidden, layers) in TRAINING:
            torch.manual_seed(0)
            bb = Backbone(config(name, layer), device="cuda", deterministic=deterministic)
            x = torch.randn(B, T, 64, device="cuda")
            resets = torch.rand(B, T, device="cuda") < 1 / 64  # episodes of ~64 steps

            def fwd_bwd():
                with amp():
                    y, _ = bb(x, resets=resets)
                y.sum().backward()

            def fwd():
                with amp():
                    bb(x, resets=resets)

            ms, peak = timed_peak(fwd_bwd, 10)
            fwd_ms = host_us(fwd, 10) / 1e3
            bb = None
            lstm = torch.nn.LSTM(inp, hidden, num_layers=layers, batch_first=True, device="cuda")
            xl = torch.randn(B, T, inp, device="cuda")

            def lstm_fwd_bwd():
                with amp():
                    y, _ = lstm(xl)
                y.sum().backward()

            lstm_ms, lstm_peak = timed_peak(lstm_fwd_bwd, 10)
            emit(shape=name, layer=layer, sequence=f"{B}x{T}", tf32_products=tf32, autocast=autocast, deterministic=deterministic,
                 forward_ms=round(fwd_ms, 2),
                 forward_backward_ms=round(ms, 2), peak_mb=round(peak), peer=f"cuDNN LSTM({inp}, {hidden}) x {layers}",
                 peer_forward_backward_ms=round(lstm_ms, 2), peer_peak_mb=round(lstm_peak),
                 time_ratio=round(ms / lstm_ms, 2), memory_ratio=round(peak / lstm_peak, 2))
            lstm = None
            torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    if layer != "mamba1":
        return
    # the kernels alone at the first shape's layer: B 16, E 256, N 16, T 1024, dt_rank 8
    from benchmarks.tune_train_scan import scan_pass

    B, E, N, T, K, R = 16, 256, 16, 1024, 4, 8
    scan = scan_pass(B, T, E, R, N)
    x = torch.randn(B, T, E, device="cuda").transpose(1, 2).requires_grad_(True)  # channels contiguous, as the layer's
    cw, cb = torch.randn(E, K, device="cuda").requires_grad_(True), torch.randn(E, device="cuda").requires_grad_(True)
    resets = torch.rand(B, T, device="cuda") < 1 / 64

    def conv():
        s = torch.zeros(B, E, K, device="cuda")
        causal_conv1d_train(x, cw, cb, s, resets=resets).sum().backward()

    for part, fn in (("scan", scan), ("conv", conv)):
        emit(part=part, shape=f"B{B} E{E} N{N} T{T}", forward_backward_ms=round(host_us(fn, 20) / 1e3, 3))
    # where 128x3's forward + backward goes: the GPU's time by kernel
    from benchmarks.profile_step import print_kernel_times

    bb = Backbone(BackboneConfig(**SHAPES["128x3"]), device="cuda")
    x = torch.randn(16, 1024, 64, device="cuda")
    resets = torch.rand(16, 1024, device="cuda") < 1 / 64
    print_kernel_times(lambda: bb(x, resets=resets)[0].sum().backward(), "128x3 forward + backward, 16 x 1024", warm=0,
                       calls=3, width=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--cpu", action="store_true", help="the batch-1 step on the CPU only")
    ap.add_argument("--sequence-only", action="store_true", help="the sequence pass only (no step, no peers)")
    ap.add_argument("--step-only", action="store_true", help="the step only (no sequence pass)")
    ap.add_argument("--training", action="store_true", help="forward + backward beside cuDNN LSTMs, and peak memory")
    ap.add_argument("--autocast", action="store_true", help="--training under torch.autocast('cuda', bfloat16)")
    ap.add_argument("--deterministic", action="store_true", help="Backbone(deterministic=True), the step's or --training's")
    ap.add_argument("--layer", default="mamba1", choices=("mamba1", "mamba2"), help="the Backbone's layers")
    ap.add_argument("--steps", default="plan", help="comma-separated: plan, kernels, lockstep (see above)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,16,256,1024,4096")
    args = ap.parse_args()
    steps = args.steps.split(",")
    if not set(steps) <= {"plan", "kernels", "lockstep"}:
        ap.error(f"--steps takes plan, kernels and lockstep, got {args.steps!r}")
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    if args.cpu:
        torch.set_num_threads(1)
        for name in SHAPES:
            bb = Backbone(config(name, args.layer))
            s = bb.new_state(1)
            x = torch.randn(1, 64)
            emit(device="cpu", shape=name, layer=args.layer, batch=1, step_us=round(host_us(lambda: bb.step(x, s), 300, sync=False), 1))
        return
    if args.training:
        training_rows(emit, args.autocast, args.deterministic, args.layer)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=2))
        return
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy rate {bw / 1e12:.2f} TB/s")
    for name in args.shapes.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            bb = Backbone(config(name, args.layer), device="cuda", dtype=dtype, deterministic=args.deterministic)
            c = bb.config
            batches = [] if args.sequence_only else [int(b) for b in args.batches.split(",")]
            for batch, step in ((b, st) for b in batches for st in steps):
                plan.LOCKSTEP_ROUTES = {"plan": PLANNED, "kernels": (), "lockstep": LOCKSTEP_EVERYWHERE}[step]
                bb._graphs.clear()
                bb._last_graph = None
                s = bb.new_state(batch)
                x = torch.randn(batch, 64, device="cuda")
                xn = x.cpu().numpy()
                moved = 2 * batch * state_bytes(c, s.ssm.element_size())  # the state read and written
                dev = host_us(lambda: bb.step(x, s), 200)
                replay = host_us(bb._last_graph.device_graph.replay, 200)  # the graph alone, no copy in or out
                host = host_us(lambda: bb.step(xn, s), 200)
                with torch.no_grad():
                    eager = host_us(lambda: bb._step_eager(x, s), 50)
                ran = type(bb._last_graph.kernels).__name__
                floor = moved / bw * 1e6
                emit(shape=name, layer=args.layer, dtype=str(dtype)[6:], deterministic=args.deterministic, batch=batch,
                     asked=step, step=ran, step_us=round(dev, 1), replay_us=round(replay, 1),
                     numpy_step_us=round(host, 1), eager_step_us=round(eager, 1), floor_us=round(floor, 1),
                     floor_fraction=round(floor / replay, 2))
            plan.LOCKSTEP_ROUTES = PLANNED
            bb._graphs.clear()
            bb._last_graph = None
            if dtype == torch.float32 and not args.step_only:
                for B, T in ((16, 64), (256, 256), (1024, 64), (16, 1024)):
                    x = torch.randn(B, T, 64, device="cuda")
                    resets = torch.rand(B, T, device="cuda") < 1 / 64  # episodes of ~64 steps
                    with torch.no_grad():
                        fwd = host_us(lambda: bb(x, resets=resets), 2)  # the prefill kernels
                        state = bb.new_state(B)
                        convs, ssms = list(state.conv.clone()), list(state.ssm.clone())
                        ref = host_us(lambda: bb._layers(x, convs, ssms, resets), 1)  # the reference ops

                    def fwd_bwd():
                        y, _ = bb(x, resets=resets)
                        y.sum().backward()
                    emit(shape=name, sequence=f"{B}x{T}", forward_ms=round(fwd / 1e3, 2),
                         reference_forward_ms=round(ref / 1e3, 1),
                         forward_backward_ms=round(host_us(fwd_bwd, 1) / 1e3, 1))
            bb = None  # free the parameters and graphs before the next shape
            torch.cuda.empty_cache()
    for kind in () if args.sequence_only else ("LSTM", "GRU"):
        for batch in (1, 256, 4096):
            emit(peer=f"cuDNN {kind}(64, 256), CUDA graph", batch=batch, step_us=round(rnn_step_us(kind, batch), 1))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=2))


if __name__ == "__main__":
    main()

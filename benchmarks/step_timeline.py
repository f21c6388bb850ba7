"""Where a batch-1 decode step's time goes, program by program: a timeline of two layers.

Writes an instrumented copy of fastmamba/kernels/decode_step.py (in a temporary
directory; the package is untouched) in which each layer kernel (in_proj, conv_x_proj,
ssm_step, out_proj, and lm_head) stores, for every program and for the chosen layers
only, the GPU's %globaltimer (ns, one clock for all SMs) when the program starts, when
its PDL wait returns, and when it ends, and the SM it ran on. Then it replays one
graph-captured step with random weights and prints, per kernel, those times' quantiles
(0, 10, 50, 90, 100%) in µs from the first layer's in_proj start.

    python -m benchmarks.step_timeline --models 2.8b,1.4b --layers 31,32

The marks are stores the programs issue and forget (no register held across a kernel's
loop): on the H200 the instrumented step ran within 0.1-3% of the plain one (both are
printed). A kernel may take more registers with its marks (the instrumented kernels'
counts are printed), which must not cost it resident programs, or the timeline shows a
second wave that the plain step does not have. Hopper only (PDL, inline PTX).
"""

import argparse
import importlib.util
import re
import tempfile
from pathlib import Path

import torch

SOURCE = Path(importlib.util.find_spec("fastmamba.kernels.decode_step").origin)
KERNELS = {"_rmsnorm_linear_kernel": "lin", "_conv_x_proj_kernel": "conv", "_ssm_step_kernel": "ssm", "_out_proj_residual_kernel": "out"}
SLOTS = ["in_proj", "conv_x_proj", "ssm_step", "out_proj", "lm_head"]  # each timed layer's kernels, in order

MARK = '''

@jit
def _timeline_mark(tm_ptr, TM_ON, col: tl.constexpr):
    # col 0: start, 1: after the wait, 2: end (and col 3 the SM); this program's row of tm
    if TM_ON != 0:
        pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        p = tm_ptr + pid.to(tl.int64) * 4
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(p + col, now)
        if col == 2:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(p + 3, sm.to(tl.int64))
'''

STEP_HOOKS = '''
    timeline = None  # (slots, programs, 4) int64, set by step_timeline.py
    timeline_layers = ()
    timeline_layer = -1
    timeline_head = False

    def timeline_args(self, kind):
        if self.timeline is None or self.timeline_layer not in self.timeline_layers:
            return dict(tm_ptr=self.h, TM_ON=0)
        slot = {"lin": 4 if self.timeline_head else 0, "conv": 1, "ssm": 2, "out": 3}[kind]
        return dict(tm_ptr=self.timeline[5 * self.timeline_layers.index(self.timeline_layer) + slot], TM_ON=1)

    def pdl_for(self, kernel: str) -> dict:'''


def _replace_once(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise SystemExit(f"step_timeline.py: decode_step.py changed shape; cannot find exactly one {old!r}")
    return src.replace(old, new)


def instrumented_source() -> str:
    """decode_step.py with the timeline marks in its layer kernels and launches."""
    src = SOURCE.read_text().replace("from ..", "from fastmamba.").replace("from .", "from fastmamba.kernels.")
    src = _replace_once(src, "\n\n@jit\ndef _embed_kernel", MARK + "\n\n@jit\ndef _embed_kernel")
    lines, out, i, done = src.split("\n"), [], 0, set()
    while i < len(lines):
        m = re.match(r"def (\w+)\($", lines[i])
        if not (m and m.group(1) in KERNELS):
            out.append(lines[i])
            i += 1
            continue
        done.add(m.group(1))
        while lines[i] != "):":  # the signature
            out.append(lines[i])
            i += 1
        out += ["    tm_ptr, TM_ON,", "):", "    _timeline_mark(tm_ptr, TM_ON, 0)"]
        i += 1
        while i < len(lines) and (lines[i].startswith(" ") or (lines[i] == "" and i + 1 < len(lines) and lines[i + 1].startswith(" "))):
            out.append(lines[i])
            if lines[i].strip() == "wait_for_prior_kernel(PDL)":
                out.append(lines[i].replace("wait_for_prior_kernel(PDL)", "_timeline_mark(tm_ptr, TM_ON, 1)"))
            i += 1
        out.append("    _timeline_mark(tm_ptr, TM_ON, 2)")
    if done != set(KERNELS):
        raise SystemExit(f"step_timeline.py: kernels not found in decode_step.py: {set(KERNELS) - done}")
    src = "\n".join(out)
    step_class = src.index("class DecodeStep")
    for name, kind in KERNELS.items():  # each launch inside DecodeStep ends with a line "        )"
        j = src.index(name + "[", step_class)
        k = src.index("\n        )\n", j)
        src = src[:k] + f"\n            **self.timeline_args({kind!r}),\n        )\n" + src[k + len("\n        )\n"):]
    src = _replace_once(src, "\n    def pdl_for(self, kernel: str) -> dict:", STEP_HOOKS)
    src = _replace_once(src, "        for i, lw in enumerate(w.layers):\n", "        self.timeline_head = False\n        for i, lw in enumerate(w.layers):\n            self.timeline_layer = i\n")
    src = _replace_once(src, "        self.lm_head(argmax)\n", "        self.timeline_head, self.timeline_layer = True, len(w.layers) - 1\n        self.lm_head(argmax)\n        self.timeline_layer = -1\n")
    return src


def load_instrumented():
    path = Path(tempfile.mkdtemp()) / "decode_step_timeline.py"
    path.write_text(instrumented_source())
    spec = importlib.util.spec_from_file_location("decode_step_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timeline(ds, size: str, layers: list[int]) -> None:
    from fastmamba.bench import gpu_ms, random_model, time_graph_steps
    from fastmamba.engine.cuda_graphs import capture_graph
    from fastmamba.engine.plan import plan_for

    model = random_model(size, torch.bfloat16)
    plain = time_graph_steps(model, 1)
    n = model.config.n_layer
    layers = sorted({*(i for i in layers if 0 <= i < n), n - 1})  # the last layer, for lm_head
    plan = plan_for(model.config, torch.bfloat16, 1)  # the plain step's: one-row, the table's launch settings
    if plan.step != "one-row":
        raise SystemExit(f"step_timeline.py: {size}'s batch-1 step is {plan.step!r}, not the one-row step")
    step = ds.DecodeStep(model, 1, plan)  # the instrumented module's
    programs = max(4096, model.config.vocab_size // 8)  # a row a program: more than any kernel here launches
    step.timeline = torch.zeros(5 * len(layers), programs, 4, dtype=torch.int64, device="cuda")
    step.timeline_layers = tuple(layers)
    state, tokens = model.new_state(1), torch.zeros(1, dtype=torch.int64, device="cuda")
    graph, _ = capture_graph(lambda: step(tokens, state))
    for _ in range(20):
        graph.replay()
    print(f"\n{size} bf16 batch 1: plain step {plain:.4f} ms, instrumented {gpu_ms(graph.replay, 50, 1)[0]:.4f} ms")
    step.timeline.zero_()
    graph.replay()
    torch.cuda.synchronize()
    tm = step.timeline.cpu()
    t0 = None
    print("µs from the first in_proj's start; quantiles 0 / 10 / 50 / 90 / 100%")
    for li, layer in enumerate(layers):
        for k, name in enumerate(SLOTS):
            marks = tm[5 * li + k]
            marks = marks[marks[:, 0] != 0]  # the programs this kernel ran
            if len(marks) == 0:
                continue
            t0 = marks[:, 0].min().item() if t0 is None else t0
            start, wait, end = [(marks[:, j] - t0).double() / 1e3 for j in range(3)]
            per_sm = torch.bincount(marks[:, 3], minlength=1)
            print(f"layer {layer:3d} {name:11s} {len(marks):5d} programs on {int((per_sm > 0).sum()):3d} SMs (at most {int(per_sm.max())} an SM)")
            for what, v in (("start", start), ("wait", wait), ("end", end)):
                q = " ".join(f"{v.quantile(p).item():8.2f}" for p in (0, 0.1, 0.5, 0.9, 1.0))
                print(f"    {what:5s} {q}")
    for name in KERNELS:
        for caches in getattr(ds, name).device_caches.values():
            regs = sorted({k.n_regs for k in caches[0].values()})
            print(f"{name}: registers a thread {regs}")
    model = step = graph = None  # free the weights and the graph before the next size
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="2.8b,1.4b")
    ap.add_argument("--layers", default="31,32", help="layers to time (the last one is always timed, for lm_head)")
    args = ap.parse_args()
    ds = load_instrumented()
    print(torch.cuda.get_device_name())
    for size in args.models.split(","):
        timeline(ds, size, [int(x) for x in args.layers.split(",")])


if __name__ == "__main__":
    main()

"""Accuracy of a bfloat16 state (load(state_dtype="bfloat16")) on the bundled model.

Greedy agreement with the float32 state over 256 tokens for three prompts, and the
logits' largest difference (relative to the largest logit) when both decode the same
4096 tokens step by step (teacher-forced; each step rounds the bf16 state once), by
position range. On the CPU the reference engine; with --device cuda the Triton one.

    python -m benchmarks.state_dtype_accuracy [--device cuda] [--dtype bfloat16]
"""

import argparse

import torch

import fastmamba


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the weights' storage dtype")
    args = ap.parse_args()
    kw = dict(device=args.device, dtype=args.dtype)
    f32, bf16 = fastmamba.load(**kw), fastmamba.load(state_dtype="bfloat16", **kw)
    print(f"{args.device}, {args.dtype} weights, engine {f32.engine}")
    for prompt in ["ROMEO.\n", "Now is the winter of our discontent", "To be, or not to be"]:
        a = f32.generate(prompt, max_tokens=256, stop_token_ids=[]).token_ids
        b = bf16.generate(prompt, max_tokens=256, stop_token_ids=[]).token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"greedy, {prompt!r}: the first {same} of 256 tokens agree")
    text = f32.generate("KING HENRY.\n", max_tokens=4096, temperature=0.8, seed=0, stop_token_ids=[]).token_ids
    ids = torch.tensor(text, device=args.device)[None]
    sa, sb = f32.model.new_state(1), bf16.model.new_state(1)
    errs = []
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            la, lb = f32.model.step(ids[:, t], sa), bf16.model.step(ids[:, t], sb)
            errs.append(((la - lb).abs().max() / la.abs().max()).item())
    for lo, hi in ((0, 256), (256, 1024), (1024, 4096)):
        part = errs[lo:hi]
        print(f"positions {lo}-{hi - 1}: logits' largest difference / largest logit: max {max(part):.2e}, "
              f"mean {sum(part) / len(part):.2e}")


if __name__ == "__main__":
    main()

"""Decode-step and prefill times of one build, for comparing two builds in one device call:
run it once under each build. bf16, random weights at public shapes (2.8b decode at batch 1,
32 and 128, 130m at batch 1, both prefilling 1 x 8192); prints one JSON line per
measurement, labelled with the build's name. Both builds must have fastmamba.bench's
random_model, time_graph_steps and prefill_ms.

    mkdir before && git archive BEFORE fastmamba | tar -x -C before   # the earlier build's package
    PYTHONPATH=before:. python -P -m benchmarks.ab_speed before; python -m benchmarks.ab_speed after

(-P, Python 3.11 and later: the current directory does not come first on the path, so
that `fastmamba` is imported from before/.)
"""

import argparse
import json

import torch

from fastmamba.bench import prefill_ms, random_model, time_graph_steps

CASES = (("2.8b", (1, 32, 128), ((1, 8192),)), ("130m", (1,), ((1, 8192),)))  # model, decode batches, prefills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label", nargs="?", default="build", help="the build's name in each line")
    label = ap.parse_args().label
    for size, batches, prefills in CASES:
        model = random_model(size, torch.bfloat16)
        for B in batches:
            print(json.dumps(dict(build=label, model=size, decode_batch=B, ms=round(time_graph_steps(model, B), 4))), flush=True)
        for B, T in prefills:
            print(json.dumps(dict(build=label, model=size, prefill=f"{B}x{T}", ms=round(prefill_ms(model, B, T), 2))), flush=True)
        model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

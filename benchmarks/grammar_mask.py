"""The host's cost of a grammar's token mask, the evidence for structured output's grammar
engine: xgrammar against llguidance on one JSON schema, `--batch` constrained slots each
drawing a random allowed token a step (seeded), the time to fill every slot's bitmask
(ceil(V / 32) int32 words a slot) a step, on one CPU thread. The constrained decode's mask is
host work on each step's critical path (it needs the step before's token), so its cost a
slot against the GPU's step time decides what a constrained slot costs.

    pip install xgrammar llguidance transformers   # (not fastmamba's dependencies)
    python -m benchmarks.grammar_mask                          # the bundled model's 4096-token vocabulary
    python -m benchmarks.grammar_mask --tokenizer tokenizer.json --batch 64
"""

import argparse
import json
import random
import time

import torch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}


def mask_ms(make, fill, accept, stopped, vocab: int, batch: int, steps: int) -> float:
    """ms a step to fill `batch` matchers' bitmasks, each then fed a random allowed token."""
    matchers = [make() for _ in range(batch)]
    mask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)
    rng = random.Random(0)
    spent = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            fill(m, mask, i)
        spent += time.perf_counter() - t
        allowed = ((mask[:, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :vocab].bool()
        for i, m in enumerate(matchers):
            ids = allowed[i].nonzero().flatten().tolist()
            if ids and not stopped(m):
                accept(m, rng.choice(ids))
    return spent / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: the bundled model's)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    from fastmamba.io.folders import default_model_dir

    torch.set_num_threads(1)
    tok = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer or str(default_model_dir() / "tokenizer.json"))
    V, schema = len(tok), json.dumps(SCHEMA)
    rows = []
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=V)).compile_json_schema(schema)
    rows.append(("xgrammar", mask_ms(lambda: xgrammar.GrammarMatcher(compiled), lambda m, mask, i: m.fill_next_token_bitmask(mask, i),
                                     lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), V, args.batch, args.steps)))
    lltok, grammar = llguidance.hf.from_tokenizer(tok, n_vocab=V), llguidance.LLMatcher.grammar_from_json_schema(schema)
    rows.append(("llguidance", mask_ms(lambda: llguidance.LLMatcher(lltok, grammar),
                                       lambda m, mask, i: llguidance.torch.fill_next_token_bitmask(m, mask, i),
                                       lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), V, args.batch, args.steps)))
    for name, ms in rows:
        print(json.dumps(dict(engine=name, vocab=V, batch=args.batch, ms_a_step=round(ms, 3),
                              us_a_slot=round(ms * 1e3 / args.batch, 1))))


if __name__ == "__main__":
    main()

"""The serving engine (scheduler.py) without HTTP: on the GPU, with the decode kernels at
changing batch sizes, each request gets what `generate` gives it alone."""

from __future__ import annotations

import pytest

import fastmamba


@pytest.mark.gpu
def test_the_engine_on_the_gpu_generates_what_generate_does_alone(text_checkpoint):
    """The scheduler with the GPU engine's decode kernels at changing batch sizes, in
    deterministic mode (a slot's logits bitwise the same at any batch size)."""
    import threading

    from fastmamba.sampling import SamplingParams
    from fastmamba.scheduler import Engine, Request

    lm = fastmamba.load(text_checkpoint, device="cuda", deterministic=True)
    engine = Engine(lm, max_batch=6, prefill_tokens=64).start()
    try:
        jobs = [(lm.encode("To be, or not to be " * (1 + k % 4)), SamplingParams(max_tokens=8 + 3 * k, temperature=0.8, seed=k,
                                                                          stop_token_ids=[])) for k in range(10)]
        outs, done = [[] for _ in jobs], threading.Semaphore(0)

        def emitter(k):
            def emit(kind, data):
                if kind == "token":
                    outs[k].append(data["token"])
                else:
                    done.release()
            return emit

        for k, (ids, params) in enumerate(jobs):
            engine.submit(Request(ids, params, emitter(k)))
        for _ in jobs:
            assert done.acquire(timeout=300)
        for k, (ids, params) in enumerate(jobs):
            assert outs[k] == lm.generate(ids, params).token_ids, k
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_chunk_prefill_graphs_continue_a_slot_as_the_eager_prefill_does(text_checkpoint):
    """The serving engine's prefill graphs (binary pieces, state copied in and out) against
    the model's own prefill over the same chunk, from the same non-zero state."""
    import torch

    from fastmamba.cuda_graphs import ChunkPrefillGraphs

    lm = fastmamba.load(text_checkpoint, device="cuda")
    model = lm.model
    graphs = ChunkPrefillGraphs(model, 64)
    ids = torch.randint(1, model.config.vocab_size, (1, 40 + 77), device="cuda")
    with torch.inference_mode():
        eager, slot = model.new_state(1), model.new_state(1)
        model.prefill(ids[:, :40], eager)
        slot.conv.copy_(eager.conv)
        slot.ssm.copy_(eager.ssm)
        want = model.prefill(ids[:, 40:], eager, last_only=True)
        got = graphs(ids[:, 40:], slot).clone()  # 77 = 64 + 8 + 4 + 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(slot.ssm, eager.ssm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(slot.conv, eager.conv, rtol=1e-4, atol=1e-4)

"""One LanguageModel shared by several threads: their calls are requests of the one engine,
and each gets what it gets alone."""

from __future__ import annotations

import threading

import pytest

import fastmamba
from fastmamba import SamplingParams

GREEDY = dict(max_tokens=18, stop_token_ids=[])


def seeded(seed: int, **kw) -> dict:
    return dict(GREEDY, temperature=0.9, seed=seed, **kw)


# (method, prompt(s), params): greedy and seeded calls of each kind
JOBS = [
    ("generate", "To be, or not", GREEDY),
    ("generate", "naïve café", seeded(1)),
    ("stream", "the slings and arrows", GREEDY),
    ("stream", "whether 'tis nobler", seeded(2, top_p=0.9)),
    ("generate_batch", ["a sea of troubles", "To be"], [GREEDY, seeded(3, top_k=5)]),
    ("generate", "outrageous fortune", seeded(4, repetition_penalty=1.3)),
    ("stream", "emoji ✓ ★ and more", seeded(5, max_tokens=25)),
    ("generate_batch", ["more text", "in the mind", "Ünïcödé wörds"], seeded(6, max_tokens=11)),
]


def run(lm, job):
    """The job's outputs as plain values: token ids and texts, finish reasons."""
    method, prompt, params = job
    if method == "stream":
        return [(p.token_id, p.text) for p in lm.stream(prompt, **params)]
    if method == "generate":
        g = lm.generate(prompt, **params)
        return g.token_ids, g.text, g.finish_reason
    params = [SamplingParams(**p) for p in params] if isinstance(params, list) else SamplingParams(**params)
    return [(g.token_ids, g.text, g.finish_reason) for g in lm.generate_batch(prompt, params)]


def in_threads(lm, jobs) -> list:
    """Runs each job in a thread of its own, all released at once; their results in order
    (an exception re-raised)."""
    results, errors = [None] * len(jobs), []
    start = threading.Barrier(len(jobs))

    def work(i):
        try:
            start.wait()
            results[i] = run(lm, jobs[i])
        except BaseException as e:  # (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a generation never finished"
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def lm(text_checkpoint):
    return fastmamba.load(text_checkpoint)


def test_eight_threads_each_get_what_they_get_alone(lm):
    alone = [run(lm, job) for job in JOBS]
    assert all(alone)
    for _ in range(3):  # (each round interleaves the threads' steps differently)
        assert in_threads(lm, JOBS) == alone


def test_threads_share_one_engine(lm):
    """The threads' requests run in the one engine, batched: it is the engine their first
    call made, and it took several requests at a step."""
    lm.generate("warm", max_tokens=2)
    client = lm._client
    seen = []
    step = client.step

    def counting_step():
        seen.append(len(client._emits))
        step()

    client.step = counting_step
    try:  # (long enough generations that the threads overlap, however fast a step)
        in_threads(lm, [("generate", f"prompt {i}", dict(GREEDY, max_tokens=150)) for i in range(6)])
    finally:
        del client.step
    assert lm._client is client
    assert max(seen) > 1


def test_a_larger_batch_while_a_stream_is_open_waits_for_free_slots(lm):
    """A call that needs more slots than the running engine has, made while another
    generation is open, runs there as requests waiting for slots (it was an error)."""
    stream = lm.stream("To be, or not", **GREEDY)
    first = next(stream)
    prompts = [f"prompt {i}" for i in range(2 * lm._client.max_batch + 1)]
    together = lm.generate_batch(prompts, SamplingParams(**GREEDY))
    rest = list(stream)
    assert [(p.token_id, p.text) for p in [first] + rest] == run(lm, JOBS[2][:1] + ("To be, or not", GREEDY))
    assert [g.token_ids for g in together] == [lm.generate(p, **GREEDY).token_ids for p in prompts]


def test_a_stream_left_open_in_one_thread_does_not_hold_up_another(lm):
    """A stream read partly and dropped, in one thread: another thread's generations go on,
    and the dropped one's requests end (its slot comes free)."""
    expected = lm.generate("naïve café", **seeded(1))
    stream = lm.stream("To be, or not", **GREEDY)
    next(stream)
    got = in_threads(lm, [("generate", "naïve café", seeded(1))] * 2)
    assert got == [(expected.token_ids, expected.text, expected.finish_reason)] * 2
    stream.close()
    assert not lm._client.busy


def test_a_call_beside_an_endless_open_stream_runs_beside_it(text_checkpoint):
    """A stream that would run forever (no stop token), read once and held open: another
    thread's generate takes a slot beside it and returns, where an engine of one slot kept it
    waiting for the stream's end (the CPU engine's slots: MIN_CPU_SLOTS at least)."""
    lm = fastmamba.load(text_checkpoint)
    endless = lm.stream("To be, or not", max_tokens=10**6, stop_token_ids=[])
    next(endless)
    assert lm._client.max_batch >= 2
    got = in_threads(lm, [("generate", "naïve café", seeded(1))])
    endless.close()
    expected = lm.generate("naïve café", **seeded(1))
    assert got == [(expected.token_ids, expected.text, expected.finish_reason)]


@pytest.mark.gpu
def test_eight_threads_on_the_gpu_engine(text_checkpoint):
    """The same on the GPU engine (CUDA graphs, a step ahead), deterministic so that a
    request's logits do not depend on what runs beside it."""
    lm = fastmamba.load(text_checkpoint, device="cuda", deterministic=True)
    alone = [run(lm, job) for job in JOBS]
    for _ in range(2):
        assert in_threads(lm, JOBS) == alone


def _child_generates(lm, prompt, conn):  # (in a forked child: its first call must not wait)
    conn.send(lm.generate(prompt, max_tokens=8, stop_token_ids=[]).token_ids)
    conn.close()


def test_a_child_forked_while_another_thread_generates_gets_its_own_engine(text_checkpoint):
    """A fork copies the engine's lock and flags, and the requests of threads the child does
    not have: a child forked while another thread was inside a generation waited for ever at
    its first call. It now makes its engine anew; and pickling a model is one clear error."""
    import multiprocessing
    import pickle

    lm = fastmamba.load(text_checkpoint)
    alone = lm.generate("To be", max_tokens=8, stop_token_ids=[]).token_ids
    running, stop = threading.Event(), threading.Event()

    def generating():
        for _ in lm.stream("a long one", max_tokens=100_000, stop_token_ids=[]):
            running.set()
            if stop.is_set():
                break

    thread = threading.Thread(target=generating, daemon=True)
    thread.start()
    try:
        assert running.wait(60)
        ctx = multiprocessing.get_context("fork")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_child_generates, args=(lm, "To be", theirs), daemon=True)
        child.start()
        try:
            assert ours.poll(60), "the forked child's generate waited"
            assert ours.recv() == alone
        finally:
            child.kill()
            child.join(30)
    finally:
        stop.set()
        thread.join(60)
    with pytest.raises(TypeError, match="fastmamba.load"):
        pickle.dumps(lm)

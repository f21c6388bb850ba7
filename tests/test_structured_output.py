"""Structured output (xgrammar): OpenAI's response_format json_object / json_schema and vLLM's
guided_regex / guided_choice, through the server (a `fastmamba serve` subprocess and the real
`openai` client), the engine core and the Python API, on the bundled model."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")
from test_engine import engine, request, run  # noqa: E402
from test_server import Server, openai  # noqa: E402

import fastmamba  # noqa: E402
from fastmamba.core.sampling_params import SamplingParams  # noqa: E402
from fastmamba.engine.protocol import Finished, Token  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person."}]
REGEX = "[a-z]{1,8} [0-9]{3}"
CHOICES = ["yes", "no", "perhaps not"]


def valid(text: str) -> bool:
    """Whether `text` is JSON that SCHEMA takes (a validator of this schema alone)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "color"} and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and type(value["age"]) is int and 0 <= value["age"] <= 120
            and value["color"] in ("red", "green", "blue"))


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch", "16", "--served-model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lm():
    return fastmamba.load()


def replies(client, n=10, seeds=(0, 100), **fields) -> list:
    out = []
    for seed in seeds:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, n=n,
                                           seed=seed, **fields)
        out += r.choices
    return out


def test_json_schema_replies_all_validate_and_unconstrained_ones_do_not(server):
    client = server.client()
    got = replies(client, response_format=JSON_SCHEMA)
    assert len(got) == 20
    for c in got:
        assert valid(c.message.content), c.message.content
        assert c.finish_reason == "stop"
    assert len({c.message.content for c in got}) > 1  # sampled, not one reply
    free = replies(client)
    assert not all(valid(c.message.content) for c in free)  # the constraint, not luck, made them valid


def test_json_object_replies_are_objects(server):
    # (the tiny model, left alone, never closes a string in 60 tokens: a bias toward '"' and '}'
    # lets it end, and the grammar masks after the bias)
    bias = {str(server.post("/tokenize", {"prompt": t})[1]["tokens"][0]): 6 for t in '"}'}
    got = replies(server.client(), n=4, seeds=(0, 7), response_format={"type": "json_object"}, logit_bias=bias)
    for c in got:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c.message.content


def test_guided_choice_and_regex_on_both_endpoints(server):
    client = server.client()
    r = client.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=1.0, n=6, seed=3,
                                  extra_body={"guided_choice": CHOICES})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in r.choices), [c.text for c in r.choices]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, n=6, seed=3,
                                       extra_body={"guided_regex": REGEX})
    for c in r.choices:
        assert re.fullmatch(REGEX, c.message.content), c.message.content
    r = client.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=1.0, n=2, seed=4,
                                  extra_body={"guided_regex": REGEX, "stop_token_ids": []})
    for c in r.choices:  # no stop token: the grammar's end ends it
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text


def test_stream_equals_non_stream_and_n2_each_valid(server):
    client = server.client()
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=11, n=2, response_format=JSON_SCHEMA)
    whole = client.chat.completions.create(**kw)
    texts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert all(valid(t) for t in texts)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}},
     "response_format", "schema"),
    ({"guided_regex": "(ab"}, "guided_regex", "regular expression"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured output"),
])
def test_a_bad_guide_is_a_400_naming_the_field(server, body, param, words):
    status, got = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert status == 400, got
    assert got["error"]["param"] == param and param in got["error"]["message"] and words in got["error"]["message"], got
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body)


BAD_SCHEMA = {"type": "json_schema",
              "json_schema": {"name": "x", "schema": {"properties": {"a": {"type": "nonsense"}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(server, stream):
    """The engine's error names the field (its message's text is not read for it), streamed
    (an error event) or not."""
    if stream:
        events = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=True,
                                                         response_format=BAD_SCHEMA)
        with pytest.raises(openai.APIError) as e:
            list(events)
        error = e.value.body
    else:
        status, got = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4,
                                                           "response_format": BAD_SCHEMA})
        assert status == 400, got
        error = got["error"]
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("'response_format': cannot compile the JSON schema"), error
    assert "nonsense" in error["message"], error


def test_an_engine_error_carries_its_field_to_the_api():
    """A guide's error crosses from the engine process with its field, which the API names (or
    the field it gives instead: a tool_choice's guide is made of `tools`)."""
    from fastmamba.engine import protocol
    from fastmamba.serve.errors import from_engine

    sent = protocol.Failed(7, protocol.EngineError(protocol.BAD_REQUEST, "cannot compile the regex: x", "guided_regex"))
    got = protocol.decoder(list[protocol.Output]).decode(protocol.encoder().encode([sent]))[0]
    assert got == sent
    error = from_engine(got.error)
    assert (error.status, error.param) == (400, "guided_regex")
    assert error.message == "'guided_regex': cannot compile the regex: x"
    error = from_engine(got.error, "tools[1].function.parameters")
    assert error.param == "tools[1].function.parameters"
    assert error.message == "'tools[1].function.parameters': cannot compile the regex: x"
    error = from_engine(protocol.EngineError(protocol.BAD_REQUEST, "no field"))
    assert (error.status, error.param, error.message) == (400, None, "no field")


@pytest.mark.parametrize("run_ahead", [False, True])
def test_guided_requests_beside_free_ones_in_one_batch(lm, run_ahead):
    """In the engine (run_ahead: the GPU's step ahead, kept while guided requests run: their
    step before is read between a step's pass and its sampling): each request, guided or
    free, gives what it gives alone; the free ones' tokens are those of a batch without any
    guide."""
    core = engine(lm, max_batch=4, tokenizer=lm.tokenizer.path)
    core.run_ahead = run_ahead
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=k, guide=("json_schema", SCHEMA) if k % 2 else None)
              for k in range(6)]
    reqs = [request(lm.encode("To be, or not to be"), p) for p in params]
    early = [r for r in reqs if r.params.guide is None][:2]  # free ones first: a step in flight when the guided come
    got = {r.rid: [[], None] for r in reqs}

    def step():
        for out in core.step():
            if isinstance(out, Token):
                got[out.rid][0].append(out.token)
            else:
                assert isinstance(out, Finished), out
                got[out.rid][1] = out.reason

    for r in early:
        core.add(r)
    for _ in range(3):
        step()
    assert (core.inflight is not None) == run_ahead
    for r in reqs:
        if r not in early:
            core.add(r)
    ahead = 0
    for _ in range(1000):
        step()
        ahead += core.inflight is not None
        if not core.has_work:
            break
    assert (ahead > 20) == run_ahead  # (the step ahead kept with guided rows decoding)
    for r in reqs:
        want = lm.generate(r.ids, r.params)
        tokens, reason = got[r.rid]
        assert tokens == want.token_ids and reason == want.finish_reason, r.rid
        if r.params.guide is not None:
            assert valid(lm.tokenizer.decode(tokens)) and reason == "stop"
    assert core.running == 0 and not core.requests and core.inflight is None


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_guided_requests_state_is_cached_at_prompt_plus_output(lm, run_ahead):
    """A guided request that ends as its step before is read between a pass and its sampling
    (run_ahead) leaves the state after every token it fed, as a free one does: the next turn
    resumes there and gets the cold prefill's tokens."""
    core = engine(lm, max_batch=2, prefill_tokens=64, prefix_cache_bytes=64 << 20, tokenizer=lm.tokenizer.path)
    core.run_ahead = run_ahead
    first = request(lm.encode("ROMEO.\nWhat say you?"), SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                                         guide=("regex", REGEX), stop_token_ids=[]))
    tokens, reason, _ = run(core, [first])[first.rid]
    assert re.fullmatch(REGEX, lm.tokenizer.decode(tokens)) and reason == "stop"
    follow = first.ids + tokens + lm.encode(" Speak again.")
    second = request(follow, SamplingParams(max_tokens=6))
    got, _, info = run(core, [second])[second.rid]
    assert info.cached_tokens == len(first.ids) + len(tokens) - (0 if run_ahead else 1)
    assert got == lm.generate(follow, max_tokens=6).token_ids


def test_two_hundred_sampled_json_schema_replies_all_validate(lm):
    """The target: 200 replies at temperature 1 on the bundled model, each its own seed, all
    valid under the schema (and none of 40 unconstrained ones: the constraint, not luck)."""
    prompts = ["Describe a person."] * 200
    guided = lm.generate_batch(prompts, [SamplingParams(max_tokens=60, temperature=1.0, seed=s,
                                                        guide=("json_schema", SCHEMA)) for s in range(200)])
    assert all(valid(g.text) and g.finish_reason == "stop" for g in guided)
    assert len({g.text for g in guided}) > 100
    free = lm.generate_batch(prompts[:40], [SamplingParams(max_tokens=60, temperature=1.0, seed=s) for s in range(40)])
    assert not any(valid(g.text) for g in free)


@pytest.mark.parametrize("seed", [25, 56, 183])
def test_a_guided_request_never_draws_a_token_its_grammar_forbids(lm, seed):
    """Seeds whose draws once hit a uniform of exactly 1 (sampling.unit_floats): its Gumbel key
    +inf, NaN beside a masked logit, and argmax took the masked token ("the grammar refused
    token ...")."""
    g = lm.generate("Describe a person.", SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                        guide=("json_schema", SCHEMA)))
    assert valid(g.text) and g.finish_reason == "stop"


def test_python_api(lm):
    g = lm.generate("ROMEO.", max_tokens=60, temperature=1.0, seed=5, guide=("json_schema", SCHEMA))
    assert valid(g.text) and g.finish_reason == "stop"
    g = lm.generate("ROMEO.", max_tokens=20, temperature=1.0, seed=5, guide=("choice", CHOICES))
    assert g.text in CHOICES
    free = lm.generate("ROMEO.", max_tokens=20, temperature=1.0, seed=5)
    batch = lm.generate_batch(["ROMEO.", "ROMEO."], [SamplingParams(max_tokens=20, temperature=1.0, seed=5),
                                                   SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                                                  guide=("regex", REGEX))])
    assert batch[0].token_ids == free.token_ids and re.fullmatch(REGEX, batch[1].text)
    with pytest.raises(ValueError, match="cannot compile the regex: .*Lookbehind"):
        lm.generate("ROMEO.", max_tokens=4, guide=("regex", "(?<=a)b"))
    with pytest.raises(ValueError, match="guide"):
        SamplingParams(guide=("yaml", "x"))


def test_a_guided_requests_logprobs_are_of_the_tokens_its_grammar_allows(lm):
    """The logprobs of a guided request are those of its masked distribution (the sampler
    reads the mask; the logprobs mask a copy), beside a free request's, unmasked."""
    core = engine(lm, max_batch=2, tokenizer=lm.tokenizer.path)
    guided = request(lm.encode("ROMEO."), SamplingParams(max_tokens=20, temperature=1.0, seed=5, guide=("choice", CHOICES)),
                     top_logprobs=5)
    free = request(lm.encode("ROMEO."), SamplingParams(max_tokens=4, temperature=1.0, seed=5), top_logprobs=5)
    entries = {guided.rid: [], free.rid: []}
    for r in (guided, free):
        core.add(r)
    while core.has_work:
        for o in core.step():
            if isinstance(o, Token):
                entries[o.rid].append((o.token, o.logprob))
    text = ""
    for token, lp in entries[guided.rid]:
        allowed = [t for t, v in lp.top if v > float("-inf")]
        assert token in allowed and lp.chosen > float("-inf")
        assert all(any(c.startswith(text + lm.tokenizer.decode([t])) for c in CHOICES) or t == lm.config.eos_token_id for t in allowed)
        text += lm.tokenizer.decode([token]) if token != lm.config.eos_token_id else ""
    assert text in CHOICES
    assert all(all(v > float("-inf") for _, v in lp.top) for _, lp in entries[free.rid])

"""Chat templates found and rendered as transformers finds and renders them: the folder's
chat_template.jinja (over tokenizer_config.json's), tokenizer_config.json's string or list
of named templates, additional_chat_templates/, --chat-template FILE and
--chat-template-name; transformers' globals and filters; the errors at start and the 400s.
Each rendering is compared with transformers' own apply_chat_template on the same folder."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime

import pytest

import fastmamba
from fastmamba.io.folders import default_model_dir
from fastmamba.io.tokenizer import Tokenizer
from fastmamba.serve.chat import ChatTemplate, TemplateRefused
from fastmamba.serve.options import ServeOptions

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": 'Be "brief" <b>, café'}, {"role": "user", "content": "Who art thou?"},
            {"role": "assistant", "content": " A ghost."}, {"role": "user", "content": "Whence?"}]
# uses bos_token, eos_token, tojson as transformers defines it (no HTML escaping) and the
# generation prompt; its block tags' indents and newlines are not output (trim_blocks, lstrip_blocks)
CHATML = """{{ bos_token }}{% for m in messages %}
<|{{ m['role'] }}|>{{ m['content'] | tojson }}{{ eos_token }}
    {% endfor %}
    {% if add_generation_prompt %}
<|assistant|>{% endif %}"""
TOOL_USE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"
RAG = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}|{% endfor %}"
ONLY_USERS = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('This model takes no system prompt, "
              "says its template') }}{% endif %}{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}Bot:")


def model_folder(tmp_path, config: dict | None = None, files: dict | None = None, name: str = "model"):
    """A copy of the bundled model with this tokenizer_config.json (bos "<s>" as an
    AddedToken object, eos a string, unless `config` says) and these files ({relative
    path: text})."""
    folder = tmp_path / name
    folder.mkdir()
    for part in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(default_model_dir() / part, folder / part)
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "eos_token": "</s>",
              **(config or {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for path, text in (files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def transformers_prompt(folder, messages=MESSAGES, chat_template: str | None = None) -> str:
    """transformers' own rendering of the folder's template (or of `chat_template`: a name
    or a template's text)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template)


def render(folder, messages=MESSAGES, **kw) -> str:
    return ChatTemplate(folder, **kw).render(messages, 1 << 20)


@contextlib.contextmanager
def app_client(folder, **options):
    """serve's app for `folder` with these ServeOptions, in this process (its prompt workers
    in theirs), over an engine that is never asked: for /tokenize."""
    from starlette.testclient import TestClient

    from fastmamba.engine.client import EngineClient
    from fastmamba.serve.app import folder_app

    class Idle(EngineClient):
        max_batch = 1
        alive = True

        def submit(self, *a, **k):
            raise AssertionError("the engine is not asked here")

        def abort(self, rid):
            pass

    with TestClient(folder_app(Idle(), folder, ServeOptions(**options))) as client:
        yield client


def served_prompt(client, folder, messages=MESSAGES) -> str:
    """The prompt the app makes of `messages`: its ids from /tokenize, which must be the
    tokenizer's ids of the text /detokenize gives back."""
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert Tokenizer(folder / "tokenizer.json").encode(text) == ids
    return text


def start_error(*flags: str) -> str:
    """`fastmamba serve` that must fail at start, before the engine loads: its one error line."""
    t0 = time.time()
    from test_server import free_port

    r = subprocess.run([sys.executable, "-m", "fastmamba.cli", "serve", "--port", str(free_port()), *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "starting the engine" not in r.stderr, r.stderr
    assert time.time() - t0 < 30
    lines = [line for line in r.stderr.splitlines() if line.startswith("fastmamba: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_chat_template_jinja_wins_over_tokenizer_config_json(tmp_path):
    folder = model_folder(tmp_path, {"chat_template": TOOL_USE}, {"chat_template.jinja": CHATML})
    expected = transformers_prompt(folder)
    assert expected == ('<s><|system|>"Be \\"brief\\" <b>, café"</s>\n<|user|>"Who art thou?"</s>\n'
                        '<|assistant|>" A ghost."</s>\n<|user|>"Whence?"</s>\n<|assistant|>')
    template = ChatTemplate(folder)
    assert template.render(MESSAGES, 1 << 20) == expected and not template.builtin
    assert template.origin == f"the chat template {folder / 'chat_template.jinja'}"
    with app_client(folder) as client:
        assert served_prompt(client, folder) == expected


def test_a_chat_template_string_in_tokenizer_config_json(tmp_path):
    folder = model_folder(tmp_path, {"chat_template": CHATML, "eos_token": {"__type": "AddedToken", "content": "<eos>"}})
    expected = transformers_prompt(folder)
    assert expected.startswith('<s><|system|>"Be') and '"Who art thou?"<eos>\n' in expected
    assert render(folder) == expected


def test_named_templates_in_tokenizer_config_json(tmp_path):
    named = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOL_USE}]
    folder = model_folder(tmp_path, {"chat_template": named})
    assert render(folder) == transformers_prompt(folder) == transformers_prompt(folder, chat_template=CHATML)
    expected = transformers_prompt(folder, chat_template="tool_use")
    assert expected == "[SYSTEM] Be \"brief\" <b>, café\n[USER] Who art thou?\n[ASSISTANT]  A ghost.\n" \
                       "[USER] Whence?\n[ASSISTANT]"
    assert render(folder, name="tool_use") == expected
    with app_client(folder, chat_template_name="tool_use") as client:
        assert served_prompt(client, folder) == expected
    with pytest.raises(ValueError, match=r"--chat-template-name nope: .* no chat template of that name \(its "
                                         r"templates: default, tool_use\)"):
        ChatTemplate(folder, name="nope")


def test_an_unknown_template_name_is_refused_at_start_naming_the_names(tmp_path):
    folder = model_folder(tmp_path, {"chat_template": [{"name": "default", "template": CHATML},
                                                       {"name": "tool_use", "template": TOOL_USE}]})
    line = start_error("--model", str(folder), "--chat-template-name", "tools")
    assert "--chat-template-name tools" in line and "default, tool_use" in line


def test_the_additional_chat_templates_folder(tmp_path):
    folder = model_folder(tmp_path, {"chat_template": TOOL_USE},
                          {"chat_template.jinja": CHATML, "additional_chat_templates/rag.jinja": RAG})
    assert render(folder) == transformers_prompt(folder)
    expected = transformers_prompt(folder, chat_template="rag")
    assert expected == 'Be "brief" <b>, café|Who art thou?| A ghost.|Whence?|'  # ({% generation %} renders its body)
    assert render(folder, name="rag") == expected
    assert ChatTemplate(folder, name="rag").origin.endswith("additional_chat_templates/rag.jinja")
    with pytest.raises(ValueError, match=r"its templates: default, rag"):
        ChatTemplate(folder, name="tool_use")  # (the files win over tokenizer_config.json's, as in transformers)
    # named templates without a default: transformers refuses to pick one, and so does the server
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no default"):
        transformers_prompt(folder)
    with pytest.raises(ValueError, match=r"none named 'default': pick one with --chat-template-name \(its "
                                         r"templates: rag\)"):
        ChatTemplate(folder)
    assert render(folder, name="rag") == expected


def test_chat_template_file_overrides_the_models(tmp_path):
    folder = model_folder(tmp_path, {"chat_template": CHATML}, {"chat_template.jinja": CHATML})
    file = tmp_path / "mine.jinja"
    file.write_text(TOOL_USE)
    expected = transformers_prompt(folder, chat_template=TOOL_USE)
    assert expected.startswith("[SYSTEM] Be") and render(folder, file=str(file)) == expected
    assert ChatTemplate(folder, file=str(file)).origin == f"the chat template {file} (--chat-template)"
    with app_client(folder, chat_template=str(file)) as client:
        assert served_prompt(client, folder) == expected
    with pytest.raises(ValueError, match="does not go with --chat-template FILE"):
        ChatTemplate(folder, file=str(file), name="default")


def test_a_missing_chat_template_file_is_an_error_at_start_naming_the_flag_and_path(tmp_path):
    missing = tmp_path / "nowhere" / "chat.jinja"
    line = start_error("--chat-template", str(missing))
    assert f"--chat-template {missing}: cannot read the chat template" in line and "No such file" in line
    with pytest.raises(ValueError, match=r"--chat-template .*: cannot read the chat template \(Is a directory\)"):
        ChatTemplate(default_model_dir(), file=str(tmp_path))


def test_strftime_now_and_loop_controls_work_as_in_transformers(tmp_path):
    # (tools: None, as transformers passes it without any)
    template = ("{{ 'T' if tools is none else 'U' }}{{ strftime_now('%Y') }}:{% for m in messages %}{% if m['role'] == 'assistant' %}{% continue %}"
                "{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}{{ m['content'] }};{% endfor %}")
    folder = model_folder(tmp_path, {"chat_template": template})
    got = render(folder)
    assert got == transformers_prompt(folder)
    assert got == f'T{datetime.now().year}:Be "brief" <b>, café;Who art thou?;'  # (the 4th message: the loop broke)


def test_raise_exception_is_a_400_carrying_the_templates_message(tmp_path):
    """End to end: a server whose model has only a chat_template.jinja (no warning at
    start) renders chats with it, and its raise_exception is the request's 400."""
    from test_server import Server

    folder = model_folder(tmp_path, files={"chat_template.jinja": ONLY_USERS})
    users = [m for m in MESSAGES if m["role"] == "user"]
    with pytest.raises(TemplateRefused, match="This model takes no system prompt, says its template"):
        ChatTemplate(folder).render(MESSAGES, 1 << 20)
    s = Server("--model", str(folder))
    try:
        status, body = s.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
        assert status == 400 and body["error"]["code"] == "chat_template_failed", body
        message = body["error"]["message"]
        assert "This model takes no system prompt, says its template" in message
        assert str(folder / "chat_template.jinja") in message
        status, body = s.post("/v1/chat/completions", {"messages": users, "max_tokens": 2})
        expected = transformers_prompt(folder, users)
        assert expected == "User: Who art thou?\nUser: Whence?\nBot:"
        assert status == 200 and body["usage"]["prompt_tokens"] == len(Tokenizer(folder / "tokenizer.json")
                                                                        .encode(expected))
        assert "warning" not in s.output()
    finally:
        s.stop()


def test_a_model_without_a_template_gets_the_plain_one_and_a_warning(tmp_path, capsys):
    from fastmamba.serve.main import check_chat_template

    folder = model_folder(tmp_path)
    assert ChatTemplate(folder).builtin and render(folder) == (
        'system: Be "brief" <b>, café\nuser: Who art thou?\nassistant: A ghost.\nuser: Whence?\nassistant:')
    check_chat_template(ServeOptions(), folder)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastmamba: warning: ") and str(folder) in lines[0]
    assert "no chat template" in lines[0]
    (folder / "chat_template.jinja").write_text(CHATML)
    check_chat_template(ServeOptions(), folder)
    assert capsys.readouterr().err == ""


def test_an_unreadable_tokenizer_config_json_is_an_error_at_start_naming_it(tmp_path):
    folder = model_folder(tmp_path)
    config = folder / "tokenizer_config.json"
    config.write_text('{"chat_template": "{{ messages }}",')
    line = start_error("--model", str(folder))
    assert f"{config} is not valid JSON" in line
    config.unlink()
    config.mkdir()  # (unreadable even to root)
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))} cannot be read \(Is a directory\)"):
        ChatTemplate(folder)
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))} cannot be read"):
        with app_client(folder):  # (a Ray Serve front end makes its app this way)
            pass
    config.rmdir()
    config.write_text(json.dumps({"chat_template": {"default": CHATML}}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))}: chat_template must be a string or a list"):
        ChatTemplate(folder)


# Gemma-3's way with OpenAI's content parts: the system prompt's first part read by index,
# each message's parts looped over (a string content printed as it is)
GEMMA_PARTS = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
               "{% set prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% set turns = messages[1:] %}"
               "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
               "{% for message in turns %}<{{ message['role'] }}>{{ prefix if loop.first else '' }}"
               "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
               "{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}|{% endfor %}<model>")
# Granite-4's: a string as it is, else the text parts joined with a newline by the template
GRANITE_PARTS = ("{% for m in messages %}{% set c = namespace(v='') %}{% if m.content is string %}{% set c.v = m.content %}"
                 "{% else %}{% for e in m.content %}{% if e.type == 'text' %}{% if c.v != '' %}{% set c.v = c.v + '\n' %}"
                 "{% endif %}{% set c.v = c.v + e.text %}{% endif %}{% endfor %}{% endif %}"
                 "<{{ m.role }}>{{ c.v }}|{% endfor %}<assistant>")
PARTS_MESSAGES = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Who art"}, {"type": "text", "text": "thou?"}]},
                  {"role": "assistant", "content": "A ghost."}, {"role": "user", "content": [{"type": "text", "text": "Whence?"}]}]


def test_content_parts_reach_a_template_that_reads_parts_as_given(tmp_path):
    """A template that loops over a message's content or indexes into it gets OpenAI's parts
    as the request gave them, and a string as a string, as transformers passes them (the
    parts were joined into one string first: a loop went over its characters and dropped the
    text, an index failed, a template's own joining was lost)."""
    from fastmamba.serve.chat import check_messages, render_limit

    gemma = model_folder(tmp_path, {"chat_template": GEMMA_PARTS}, name="gemma")
    expected = transformers_prompt(gemma, PARTS_MESSAGES)
    assert expected == "<s><user>Be brief.\n\nWho artthou?|<assistant>A ghost.|<user>Whence?|<model>"
    checked = check_messages(PARTS_MESSAGES)
    assert ChatTemplate(gemma).render(checked, render_limit(checked)) == expected
    with app_client(gemma) as client:
        assert served_prompt(client, gemma, PARTS_MESSAGES) == expected
    granite = model_folder(tmp_path, {"chat_template": GRANITE_PARTS}, name="granite")
    expected = transformers_prompt(granite, PARTS_MESSAGES)
    assert expected == "<system>Be brief.|<user>Who art\nthou?|<assistant>A ghost.|<user>Whence?|<assistant>"
    assert ChatTemplate(granite).render(checked, render_limit(checked)) == expected


def test_content_parts_are_joined_with_a_newline_for_a_template_that_takes_strings(tmp_path):
    """A template that reads a message's content as a string gets its text parts joined with
    a newline, as vLLM joins them (they were joined with nothing)."""
    from fastmamba.serve.chat import check_messages, render_limit

    folder = model_folder(tmp_path, {"chat_template": CHATML})
    joined = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
               else "\n".join(part["text"] for part in m["content"])} for m in PARTS_MESSAGES]
    expected = transformers_prompt(folder, joined)
    assert '<|user|>"Who art\\nthou?"</s>' in expected
    checked = check_messages(PARTS_MESSAGES)
    assert ChatTemplate(folder).render(checked, render_limit(checked)) == expected
    plain = ChatTemplate(model_folder(tmp_path, name="plain"))
    assert plain.render(checked, render_limit(checked)).startswith("system: Be brief.\nuser: Who art\nthou?\n")


def test_special_tokens_of_special_tokens_map_json_as_transformers_reads_them(tmp_path):
    """A checkpoint saved by older transformers keeps its special tokens in
    special_tokens_map.json: the template gets them (they rendered empty), over
    tokenizer_config.json's, unless tokenizer_config.json has an added_tokens_decoder (then
    transformers reads no special_tokens_map.json)."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    folder = model_folder(tmp_path)
    config, legacy = folder / "tokenizer_config.json", folder / "special_tokens_map.json"
    config.write_text(json.dumps({"chat_template": template}))
    legacy.write_text(json.dumps({"bos_token": {"content": "<s>", "lstrip": False, "normalized": False,
                                                "rstrip": False, "single_word": False}, "eos_token": "</s>"}))
    messages = MESSAGES[1:3]
    expected = transformers_prompt(folder, messages)
    assert expected == "<s>[user] Who art thou?</s>[assistant]  A ghost.</s>"
    assert render(folder, messages) == expected
    config.write_text(json.dumps({"chat_template": template, "eos_token": "<eos>"}))
    assert render(folder, messages) == transformers_prompt(folder, messages) == expected
    config.write_text(json.dumps({"chat_template": template, "eos_token": "<eos>", "added_tokens_decoder": {}}))
    expected = transformers_prompt(folder, messages)
    assert expected == "[user] Who art thou?<eos>[assistant]  A ghost.<eos>"
    assert render(folder, messages) == expected
    config.write_text(json.dumps({"chat_template": template}))
    legacy.write_text('["<s>"]')
    with pytest.raises(ValueError, match=rf"{re.escape(str(legacy))} is not a JSON object"):
        ChatTemplate(folder)
    legacy.write_text('{"bos_token": ')
    line = start_error("--model", str(folder))
    assert f"{legacy} is not valid JSON" in line


def test_tokenize_refuses_a_field_it_does_not_serve_naming_it(tmp_path):
    """/tokenize refuses what it would ignore (a typo of a field, vLLM's chat options), as
    the chat endpoint does: a 200 would give ids of another prompt than the client meant."""
    folder = model_folder(tmp_path, {"chat_template": CHATML})
    with app_client(folder) as client:
        for field, value in (("add_generation_promt", False), ("continue_final_message", True),
                             ("chat_template_kwargs", {"enable_thinking": False}), ("temperature", 0)):
            r = client.post("/tokenize", json={"messages": MESSAGES, field: value})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == field and error["code"] == "unrecognized_field"
            assert error["message"].startswith(f"unrecognized request field '{field}'; /tokenize takes messages")
        r = client.post("/tokenize", json={"prompt": "To be", "messages": MESSAGES})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = client.post("/tokenize", json={"prompt": "To be", "tool_choice": "none"})
        assert r.status_code == 400 and "'tool_choice' goes with 'messages'" in r.json()["error"]["message"]
        r = client.post("/tokenize", json={"prompt": "To be", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = client.post("/tokenize", json={"prompt": "To be", "model": "fastmamba-default"})
        assert r.json()["tokens"] == Tokenizer(folder / "tokenizer.json").encode("To be")
        assert served_prompt(client, folder) == transformers_prompt(folder)
        r = client.post("/detokenize", json={"tokens": [1, 2], "skip_special_tokens": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"
        assert client.post("/detokenize", json={"tokens": [1], "model": "other"}).status_code == 404


def test_a_template_that_does_not_compile_is_an_error_at_start_naming_where_it_came_from(tmp_path):
    folder = model_folder(tmp_path, files={"chat_template.jinja": "{% for m in messages %}{{ m['content'] }}"})
    line = start_error("--model", str(folder))
    assert f"the chat template {folder / 'chat_template.jinja'} does not compile" in line and "endfor" in line
    folder = model_folder(tmp_path, {"chat_template": [{"name": "default", "template": CHATML},
                                                       {"name": "broken", "template": "{{ messages"}]}, name="named")
    assert render(folder) == transformers_prompt(folder)
    with pytest.raises(ValueError, match=rf"the chat template 'broken' of {re.escape(str(folder / 'tokenizer_config.json'))} does "
                                         r"not compile: .*\(line 1\)"):
        ChatTemplate(folder, name="broken")


def test_a_text_prompt_takes_the_tokenizers_bos_and_a_chat_the_templates_alone(tmp_path):
    """A tokenizer whose post-processor starts every text with a BOS (Llama-3's, Bamba's):
    a completion's prompt and generate's text prompt get it, as transformers' tokenizer(text)
    and vLLM's completions give (fastmamba's had none); a chat's rendered text gets only the
    one its template writes."""
    folder = model_folder(tmp_path, config={"bos_token": "<|endoftext|>",
                                            "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                                             "{% endfor %}"})
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = {"id": "<|endoftext|>", "type_id": 0}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": bos},
                                                                     {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    plain = Tokenizer(folder / "tokenizer.json").encode("To be, or not")
    assert plain[0] != 0
    with app_client(folder) as client:
        assert client.post("/tokenize", json={"prompt": "To be, or not"}).json()["tokens"] == [0] + plain
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "To be, or not"}]}).json()
        assert chat["tokens"] == [0] + plain
    assert fastmamba.load(folder).encode("To be, or not") == [0] + plain
    # the plain template (the model has none) writes no special tokens: the tokenizer's BOS leads
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    with app_client(folder) as client:
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "To be, or not"}]}).json()
    assert chat["tokens"][0] == 0 and chat["tokens"].count(0) == 1

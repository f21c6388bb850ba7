"""The `fastmamba` command end to end, in a subprocess as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fastmamba


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastmamba.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_streams_the_same_text_as_the_api(text_checkpoint):
    r = run("generate", "--model", str(text_checkpoint), "--max-tokens", "12", "To be, or not")
    assert r.returncode == 0, r.stderr
    expected = fastmamba.load(text_checkpoint).generate("To be, or not", max_tokens=12).text
    assert r.stdout == expected + "\n"


def test_sampling_flags_reach_the_sampler(text_checkpoint):
    args = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.01"]
    args += ["--repetition-penalty", "1.1", "--seed", "7", "--max-tokens", "10", "--dtype", "bf16"]
    args += ["--presence-penalty", "1.5", "--frequency-penalty", "0.5"]
    r = run("generate", "--model", str(text_checkpoint), *args, "To be")
    assert r.returncode == 0, r.stderr
    lm = fastmamba.load(text_checkpoint, dtype="bfloat16")
    kw = dict(max_tokens=10, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=7)
    g = lm.generate("To be", **kw, presence_penalty=1.5, frequency_penalty=0.5)
    assert r.stdout == g.text + "\n"
    assert g.token_ids != lm.generate("To be", **kw).token_ids  # (the penalties change this text: they reached it)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0]


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run("generate", "--model", str(tmp_path / "nope"), "hi"), "nope")


def test_broken_checkpoint_names_the_file(tmp_path, text_checkpoint):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(text_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    assert_one_line_error(run("generate", "--model", str(broken), "hi"), "model.safetensors")


def test_bad_flag_values(text_checkpoint):
    assert_one_line_error(run("generate", "--model", str(text_checkpoint), "--temperature", "-1", "hi"), "--temperature")
    # (the flag the user typed, not the library's field: SamplingParams.max_tokens)
    r = run("generate", "--model", str(text_checkpoint), "--max-tokens", "0", "hi")
    assert_one_line_error(r, "--max-tokens must be an integer >= 1, got 0")
    assert "SamplingParams" not in r.stderr
    assert_one_line_error(run("generate", "--model", str(text_checkpoint), "--dtype", "int4", "hi"), "dtype")
    r = run("generate", "--model", str(text_checkpoint), "--max-tokens", "many", "hi")
    assert r.returncode == 2 and "--max-tokens" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_the_options():
    r = run("generate", "--help")
    assert r.returncode == 0
    for flag in ["--model", "--device", "--dtype", "--max-tokens", "--temperature", "--top-k", "--top-p",
                 "--min-p", "--repetition-penalty", "--seed"]:
        assert flag in r.stdout


# -- the one-line promise under odd conditions ----------------------------------------------


def test_argparse_errors_are_one_line():
    assert_one_line_error(run("generate"), "PROMPT")
    assert_one_line_error(run("generate", "--no-such-flag", "hi"), "--no-such-flag")
    assert_one_line_error(run("nonsense"), "nonsense")


def test_an_empty_model_flag():
    assert_one_line_error(run("generate", "--model", "", "hi"), "--model")


def test_a_model_without_tokenizer_speaks_cli(checkpoints):
    assert_one_line_error(run("generate", "--model", str(checkpoints["odd_vocab_tied"]), "hi"), "tokenizer.json", "--model")


def test_a_prompt_that_is_not_utf8(text_checkpoint):
    r = subprocess.run([sys.executable, "-m", "fastmamba.cli", "generate", "--model", str(text_checkpoint),
                        b"To be \xff"], capture_output=True, timeout=120)
    assert r.returncode == 2 and b"Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and b"UTF-8" in r.stderr and b"0xff" in r.stderr


def test_a_broken_pipe_exits_quietly(text_checkpoint):
    cmd = f"{sys.executable} -m fastmamba.cli generate --model {text_checkpoint} --max-tokens 400 'To be' | head -c 10"
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=120)
    assert len(r.stdout) <= 10 and r.stderr == "" and r.returncode == 141


def test_a_closed_stdout_exits_quietly(text_checkpoint):
    cmd = f"{sys.executable} -m fastmamba.cli generate --model {text_checkpoint} --max-tokens 4 'To be' >&-"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.stderr == "" and r.returncode == 141


def test_threads_flag(text_checkpoint):
    r = run("generate", "--model", str(text_checkpoint), "--threads", "2", "--max-tokens", "4", "To be")
    assert r.returncode == 0 and r.stdout == fastmamba.load(text_checkpoint).generate("To be", max_tokens=4).text + "\n"
    assert_one_line_error(run("generate", "--threads", "0", "hi"), "--threads")


def test_threads_beyond_the_cores_is_refused_by_name():
    import os

    r = run("generate", "--threads", "100000", "hi")
    assert_one_line_error(r, "--threads", str(os.cpu_count()))


def test_no_command_prints_usage_to_stderr():
    r = run()
    assert r.returncode == 2 and r.stdout == "" and "usage: fastmamba" in r.stderr and "command" in r.stderr


def test_an_argparse_error_names_the_program_once():
    r = run("generate", "--max-tokens", "x", "hi")
    assert_one_line_error(r, "--max-tokens", "fastmamba generate --help")
    assert r.stderr.startswith("fastmamba: error: argument --max-tokens") and r.stderr.count("fastmamba") == 2


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_serve_refuses_a_port_out_of_range(port):
    assert_one_line_error(run("serve", "--port", port), "--port", port)


def test_serve_refuses_a_port_in_use():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = str(s.getsockname()[1])
        assert_one_line_error(run("serve", "--port", port), "--port", port, "in use")


@pytest.mark.parametrize("flag,value", [("--max-body-mb", "0"), ("--shutdown-timeout", "-1"), ("--max-model-len", "0"),
                                        ("--max-batch", "0")])
def test_serve_flags_out_of_range(flag, value):
    assert_one_line_error(run("serve", flag, value), flag)


# Ctrl-C through the command's own entry (fastmamba/__main__.py, the console script's), run
# with an import hook that pauses the command at a chosen import (touching a file first):
# the signal then lands inside that import for certain, however fast or loaded the machine.
_PAUSE_AT = """
import importlib.abc, pathlib, runpy, sys, time
flag, module = pathlib.Path(sys.argv.pop(1)), sys.argv.pop(1)
class PauseAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == module:
            sys.meta_path.remove(self)
            flag.touch()
            time.sleep(60)
        return None
sys.meta_path.insert(0, PauseAt())
runpy.run_module("fastmamba", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ["fastmamba.cli", "torch", "safetensors", "tokenizers"])
def test_ctrl_c_at_any_import_of_the_entry_is_quiet(text_checkpoint, tmp_path, module):
    import signal
    import time

    pausing = tmp_path / "pausing"
    p = subprocess.Popen([sys.executable, "-c", _PAUSE_AT, str(pausing), module,
                          "generate", "--model", str(text_checkpoint), "hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):  # bounded: 60 s
        if pausing.exists() or p.poll() is not None:
            break
        time.sleep(0.05)
    assert pausing.exists(), f"the command never imported {module}"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and out == "" and err == "", (p.returncode, err)


def test_ctrl_c_while_generating_is_quiet():
    import signal

    p = subprocess.Popen([sys.executable, "-m", "fastmamba", "generate", "--max-tokens", "100000", "To be"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(1)  # text is flowing
    assert first, p.stderr.read()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == b""


@pytest.mark.parametrize("spec", ["4", "3:1", "x:y", "0:0"])
def test_serve_refuses_a_bad_autoscale(spec):
    assert_one_line_error(run("serve", "--autoscale", spec), "--autoscale")


@pytest.mark.parametrize("value", ["-1", "20000", "nan"])
def test_serve_refuses_a_bad_stream_interval(value):
    assert_one_line_error(run("serve", "--replicas", "2", "--stream-interval-ms", value), "--stream-interval-ms")


def test_a_cpu_engine_prefills_a_short_budget_a_step(text_checkpoint):
    """A step is silent while it runs, and the front end calls an engine silent for
    --engine-timeout (30 s) wedged: the CPU's default budget keeps a step to seconds."""
    from fastmamba.engine.options import EngineOptions, build_engine

    core, ready = build_engine(EngineOptions(model=str(text_checkpoint), max_batch=2))
    assert (ready.device, core.prefill_tokens) == ("cpu", 512)
    core, _ = build_engine(EngineOptions(model=str(text_checkpoint), max_batch=2, prefill_tokens=64))
    assert core.prefill_tokens == 64
    assert EngineOptions(device="cuda").step_prefill_tokens() == 4096

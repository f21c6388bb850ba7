"""A CPU install without Triton (what the README's `pip install -e .` leaves): the package
imports and generates. Run in a subprocess where `import triton` fails, whatever this
machine has installed."""

from __future__ import annotations

import subprocess
import sys

import fastmamba

BLOCK_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton...` now raises ImportError
sys.modules["triton.language"] = None
try:
    import triton
except ImportError:
    pass
else:
    raise SystemExit("triton still imports")
"""


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + code], capture_output=True, text=True, timeout=300)


def test_import_and_generate_without_triton():
    code = """
import pkgutil, importlib
import fastmamba
for m in pkgutil.walk_packages(fastmamba.__path__, "fastmamba."):
    importlib.import_module(m.name)  # every module, kernels included
assert not fastmamba.HAVE_TRITON
print(fastmamba.load().generate("To be, or not to be", max_tokens=12).text, end="")
"""
    r = run_without_triton(code)
    assert r.returncode == 0, r.stderr
    expected = fastmamba.load().generate("To be, or not to be", max_tokens=12).text
    assert expected and r.stdout == expected


def test_cli_generate_without_triton():
    r = run_without_triton(
        "from fastmamba.cli import main\nraise SystemExit(main(['generate', '--max-tokens', '8', 'ROMEO.']))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout == fastmamba.load().generate("ROMEO.", max_tokens=8).text + "\n"

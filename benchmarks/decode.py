"""Decode benchmark (also `fastmamba bench`): see fastmamba/bench.py."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastmamba.bench import main_from_args  # noqa: E402
from fastmamba.cli import add_bench_arguments  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_bench_arguments(ap)
    sys.exit(main_from_args(ap.parse_args()))

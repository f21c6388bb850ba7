"""Decode benchmark (also `fastmamba bench`): see fastmamba/bench.py."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastmamba.bench import add_arguments, main_from_args  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    sys.exit(main_from_args(ap.parse_args()))

"""The `fastmamba` command's entry (the console script, and `python -m fastmamba`): Ctrl-C is
made to end the command quietly (interrupts.py) before anything slow is imported."""

import sys

from fastmamba.interrupts import end_quietly_on_ctrl_c

end_quietly_on_ctrl_c()


def main() -> int:
    from fastmamba.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())

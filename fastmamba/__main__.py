"""The `fastmamba` command's entry (the console script, and `python -m fastmamba`).

Ctrl-C must end the command quietly with exit code 130 at any moment, and Python's own
handler cannot promise it: a KeyboardInterrupt raised while a module is still importing
prints a traceback, and one raised inside a library that catches it is lost. So this module
imports nothing slow, and its first act is a handler that ends the process at once. (`serve`
replaces it with uvicorn's, which drains running requests first.)
"""

import os
import signal
import sys


def _interrupted(signum, frame):
    os._exit(130)


try:
    signal.signal(signal.SIGINT, _interrupted)
except ValueError:  # imported outside the main thread: not the command, leave Python's handler
    pass


def main() -> int:
    from .cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())

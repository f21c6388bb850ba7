"""Ctrl-C for the command: the process ends at once with exit code 130, quietly.

Python's own handler cannot promise that: a KeyboardInterrupt raised while a module is still
importing prints a traceback, and one raised inside a library that catches it is lost. The
command's entries (`fastmamba.__main__`, and `python -m fastmamba.cli`) install this handler
before they import anything slow. (`serve` replaces it with uvicorn's, which drains running
requests first.)
"""

import os
import signal


def _interrupted(signum, frame):
    os._exit(130)


def end_quietly_on_ctrl_c() -> None:
    """SIGINT ends the process with 130, unless this is not the main thread (then the process
    is not the command, and Python's handler stays)."""
    try:
        signal.signal(signal.SIGINT, _interrupted)
    except ValueError:
        pass

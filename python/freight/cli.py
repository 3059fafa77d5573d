"""The ``freight`` command line (``freight ...`` or ``python -m freight ...``).

The commands themselves are implemented in Rust (crate freight-cli); this module only
hands over the arguments and how to start the CLI again in a child process.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional, Sequence


def self_command() -> List[str]:
    """How child processes start this CLI again: ``[python, -m, freight]``."""
    return [sys.executable, "-m", "freight"]


def run(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the CLI with ``argv`` (without the program name; default ``sys.argv[1:]``)
    and returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["proxy"]:
        # The P/D proxy is an aiohttp server: it lives in Python, with its own options.
        from .proxy import main as proxy_main

        return proxy_main(args[1:])
    command, level = _split_log_level(args)
    if command[:2] == ["bench", "ep"]:
        # Expert parallelism runs on PyTorch tensors: its benchmark lives in Python.
        from . import ep_bench

        if level is not None:
            # The engine's log filter, as the native CLI's --log-level sets it.
            os.environ["FREIGHT_LOG"] = level
        return ep_bench.main(command[2:])
    from . import _native

    return _native.cli_main(["freight", *args], self_command())


def _split_log_level(args: list) -> tuple:
    """The command line without its ``--log-level LEVEL`` (or ``--log-level=LEVEL``)
    options, and the last level given. The option is global in the native CLI, so it
    may come anywhere: before the command, between ``bench`` and ``ep``, or after."""
    rest: list = []
    level = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        if arg.startswith("--log-level="):
            level = arg.split("=", 1)[1]
        elif arg == "--log-level" and i + 1 < len(args):
            level = args[i + 1]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, level


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``freight`` script: runs the CLI and exits with its status."""
    # Behave like a native command line: Ctrl-C and a closed pipe end the process
    # (the Rust code runs without the GIL, so Python's handlers would only run after it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(run(argv))


if __name__ == "__main__":
    main()

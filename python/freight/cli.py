"""The ``freight`` command line (``freight ...`` or ``python -m freight ...``).

The commands themselves are implemented in Rust (crate freight-cli); this module only
hands over the arguments and how to start the CLI again in a child process.
"""

from __future__ import annotations

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
    from . import _native

    return _native.cli_main(["freight", *args], self_command())


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

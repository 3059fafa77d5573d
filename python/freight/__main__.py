"""``python -m freight``: the freight command line."""

from .cli import main

main()

"""``python -m freight.nixl --shim-path``: the directory to put first on PYTHONPATH so
that unchanged NIXL programs run on freight."""

import argparse

from . import shim_path

parser = argparse.ArgumentParser(prog="python -m freight.nixl", description=__doc__)
parser.add_argument("--shim-path", action="store_true", help="print the alias directory and exit")
args = parser.parse_args()
if args.shim_path:
    print(shim_path())
else:
    parser.print_help()

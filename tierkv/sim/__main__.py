"""``python -m tierkv.sim [args]``: ``tierkv sim`` on its own."""

import sys

from tierkv.cli.main import main

sys.exit(main(["sim", *sys.argv[1:]]))

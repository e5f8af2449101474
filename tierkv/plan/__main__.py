"""``python -m tierkv.plan [args]``: ``tierkv plan`` on its own."""

import sys

from tierkv.cli.main import main

sys.exit(main(["plan", *sys.argv[1:]]))

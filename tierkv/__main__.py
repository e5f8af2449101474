"""``python -m tierkv``: the same command line as the ``tierkv`` script."""

import sys

from tierkv.cli import main

sys.exit(main())

"""``python -m tierkv``: the same command line as the ``tierkv`` script."""

import sys

from tierkv.cli.main import main

sys.exit(main())

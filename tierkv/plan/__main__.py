"""``python -m tierkv.plan [args]``: ``tierkv plan`` on its own."""

import sys

from tierkv.plan.cli import main

sys.exit(main())

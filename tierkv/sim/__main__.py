"""``python -m tierkv.sim ...`` runs ``tierkv sim`` on its own."""

import sys

from tierkv.sim.cli import main_sim

sys.exit(main_sim())

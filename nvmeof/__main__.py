"""``python3 -m nvmeof``: runs :func:`nvmeof.cli.main`."""

import sys

from nvmeof.cli import main

sys.exit(main())

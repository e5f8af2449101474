#!/usr/bin/env bash
# The project's test command: lint (ruff) and type-check the package and the tests, run the whole test suite, then the
# NVMe-oF rig tests inside a QEMU guest (`tierkv rig test`, about 4 minutes on 2 cores; it
# fails the run when they fail). The rig runs only for the whole suite (no arguments);
# TIERKV_RIG=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m ruff check tierkv nvmeof tests tools
python3 -m mypy tierkv nvmeof tests
python3 -m pytest -q "$@"
if [ $# -eq 0 ] && [ "${TIERKV_RIG:-1}" != 0 ]; then
    python3 -m tierkv rig test
fi

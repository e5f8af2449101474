#!/usr/bin/env bash
# The project's test command: type-check the package, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m mypy tierkv
python3 -m pytest -q "$@"

"""Benchmarks of tierkv's tiers, each against a baseline measured in the same run.

:func:`check_dir` is shared by the suites that write files (``store``, ``codec-store``).
"""

from __future__ import annotations

import os

from tierkv.errors import InputError


def check_dir(path: str | None) -> None:
    """InputError naming ``--dir`` unless ``path`` (None: a temporary directory) is a
    writable directory, so that a typo is bad input (exit 2), not an errno mid-run."""
    if path is None:
        return
    if not os.path.isdir(path):
        raise InputError(f"--dir: {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"--dir: {path} is not writable")

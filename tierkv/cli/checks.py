"""Argument checks that more than one subcommand makes before any work, so that bad input
costs nothing: a plot's path and matplotlib (``tierkv plan --plot``, ``tierkv sim --plot``).

Called by :mod:`tierkv.cli.plan` and :mod:`tierkv.cli.sim`; imports only the standard library
and :mod:`tierkv.errors`. Each check raises :class:`~tierkv.errors.InputError` (exit 2).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tierkv.errors import InputError


def check_plot(path: str) -> None:
    """``--plot PATH``: a ``.png`` name in an existing, writable folder, and matplotlib installed."""
    if not path.lower().endswith(".png"):
        raise InputError(f"--plot: expected a .png file name, got {path!r}")
    folder = Path(path).parent
    if Path(path).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InputError(f"--plot: cannot write {path!r}: expected a file name in an existing, writable folder")
    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("--plot needs matplotlib: pip install matplotlib (or tierkv[plot])")

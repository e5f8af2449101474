"""A progress bar on stderr for long CLI work (replay, bench), shared so both look alike.

Shown only when enabled and stderr is a terminal, so ``--json`` output and CI logs
stay clean.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def task_progress(label: str, total: int | None, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Yields a function that advances the bar by one step."""
    if not enabled or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    task = progress.add_task(label, total=total)
    with progress:
        yield lambda: progress.advance(task)

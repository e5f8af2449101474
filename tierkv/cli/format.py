"""``tierkv format PATH [--yes] [--json]``: show what is on a file or block device, and
hand it to tierkv.

Registered by ``tierkv.cli.main``. It reports the kind and size, the signatures ``blkid -p``
and tierkv's own checks find, whether non-zero bytes were read, and the tierkv label and
its owner if there is one (:func:`tierkv.store.medium.examine`). With ``--yes``, or a
``yes`` typed at the prompt when stdin is a terminal, it zeroes the first and last MiB and
writes the marker that lets any store take the medium (:func:`~tierkv.store.medium.format_medium`).
Exit status: 0 when formatted, or when a store may take the medium as it is (missing,
empty, blank, already marked); 1 when it was not formatted and a store would refuse it;
2 for a path that is neither a file nor a block device; 1 for one in use (mounted, or
held by a store's writer).
"""

from __future__ import annotations

import argparse
import json
import sys

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import InputError
from tierkv.store.medium import TAIL_BYTES, Contents, Medium, examine, format_medium
from tierkv.units import format_size


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``format`` to ``tierkv``'s subparsers."""
    p = subparsers.add_parser(
        "format", help="show what is on a file or device; with --yes, erase its signatures so a store may take it",
        description="A store takes only a missing path, an empty file, a blank medium or its own label. This shows "
                    "what PATH holds and, with --yes (or a confirmation at a terminal), zeroes its first and last "
                    f"{TAIL_BYTES >> 20} MiB and marks it for tierkv; the rest of its bytes are left as they are.")
    p.add_argument("path", metavar="PATH", help="a regular file or a block device")
    p.add_argument("--yes", action="store_true", help="format without asking")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.set_defaults(handler=cmd_format)
    return p


def cmd_format(args: argparse.Namespace) -> int:
    found = examine(args.path)
    if found.kind in ("directory", "other"):
        raise InputError(f"{args.path} is a {found.kind}; tierkv format takes a regular file or a block device")
    erased: tuple[tuple[int, int], ...] = ()
    nothing = found.contents in (Contents.MISSING, Contents.EMPTY)
    if not nothing and (args.yes or _confirmed(found, args.json)):
        erased = format_medium(found.path)
        after = examine(found.path)
    else:
        after = found
    out = {**found.as_json(), "formatted": bool(erased), "erased": [list(span) for span in erased],
           "store_may_take": after.contents.takeable}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _summary(found, erased, after)
    return EXIT_OK if after.contents.takeable else EXIT_FAILED


def _confirmed(found: Medium, quiet: bool) -> bool:
    """Ask at a terminal (on stderr); never without one."""
    if not sys.stdin.isatty():
        return False
    if not quiet:
        _summary(found, (), found)
    print(f"Erase the first and last {TAIL_BYTES >> 20} MiB of {found.path} and mark it for tierkv? "
          "Type yes: ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip() == "yes"


def _summary(found: Medium, erased: tuple[tuple[int, int], ...], after: Medium) -> None:
    if found.kind == "missing":
        print(f"{found.path}: does not exist; a store creates it")
        return
    print(f"{found.path}: {found.kind}, {found.size_bytes} bytes ({format_size(found.size_bytes)})")
    print(f"  contents:   {found.describe().split(': ', 1)[-1]}")
    if found.contents is Contents.FOREIGN:
        print(f"  blkid:      {found.blkid}")
    if erased:
        spans = ", ".join(f"{n} bytes at {at}" for at, n in erased)
        print(f"  formatted:  zeroed {spans}; marked for tierkv: a store may take it")
    elif after.contents.takeable:
        print("  a store may take it as it is")
    elif found.contents is Contents.TIERKV:
        print(f"  the store that labelled it reopens it, any other refuses it; 'tierkv format {found.path} --yes' "
              "hands it over (that store's pages on it are lost)")
    else:
        print(f"  a store refuses it; 'tierkv format {found.path} --yes' zeroes its first and last "
              f"{TAIL_BYTES >> 20} MiB and marks it for tierkv (its data is lost)")
